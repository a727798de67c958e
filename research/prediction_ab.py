"""Predicted outputs against none: one request at a time, the same engine, in one process.

`python -m research.prediction_ab [--trace bench/traces/quoting.json] [--rounds 3]
 [--model smollm2-135m] [--prediction reply|garbage]`

Each request's greedy reply is computed once (speculation on, as served). Then, round after
round, every request runs without a prediction and with one, who goes first flipping every
round: `reply` predicts the reply's own text (a client that knows the answer, as when it sends
back a file it expects mostly unchanged: the most a prediction can give), `garbage` a text
unlike it (what a wrong one costs). The prediction is the text tokenized as the gateway does
(no special tokens). Earlier replies are off (`--speculative-history-tokens 0`), or the
repeated requests would draft from themselves. Reports tokens/s both ways, the speed-up of the
means (the rounds' own range), drafts kept, and whether the tokens agreed.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.speculative_options import SpeculativeOptions
from generation.sampling_params import SamplingParams

GARBAGE = "nothing like the reply at all; " * 20


def timed(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[float, list[int], int]:
    """Seconds, tokens, drafts kept."""
    kept = engine.stats.num_accepted_tokens_total
    started = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    return (
        time.perf_counter() - started,
        out.token_ids,
        engine.stats.num_accepted_tokens_total - kept,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="bench/traces/quoting.json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prediction", choices=("reply", "garbage"), default="reply")
    args = p.parse_args(argv)
    requests = json.loads(Path(args.trace).read_text())["requests"]
    no_history = SpeculativeOptions(history_tokens=0)
    engine = Engine(EngineConfig(model=args.model, max_num_seqs=1, speculative=no_history))
    tokenizer = engine.loaded.tokenizer
    cases = []
    for r in requests:
        params = SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True)
        reply = engine.generate([r["prompt_ids"]], params)[0].token_ids
        text = tokenizer.decode(reply) if args.prediction == "reply" else GARBAGE
        predicted = tuple(tokenizer.encode(text, add_special_tokens=False))
        cases.append((r["prompt_ids"], params, replace(params, prediction_token_ids=predicted)))
    rates: dict[str, list[float]] = {"none": [], "prediction": []}
    kept = {"none": 0, "prediction": 0}
    same = True
    for round_ in range(args.rounds):
        seconds = {"none": 0.0, "prediction": 0.0}
        tokens = 0
        for prompt, plain, predicted in cases:
            runs = [("none", plain), ("prediction", predicted)]
            outs = {}
            for mode, params in runs if round_ % 2 == 0 else runs[::-1]:
                s, out, k = timed(engine, prompt, params)
                seconds[mode] += s
                kept[mode] += k
                outs[mode] = out
            same &= outs["none"] == outs["prediction"]
            tokens += len(outs["none"])
        for mode in rates:
            rates[mode].append(tokens / seconds[mode])
        ratio = rates["prediction"][-1] / rates["none"][-1]
        print(f"round {round_ + 1}: prediction {ratio:.3f}x", flush=True)
    ratios = [a / b for a, b in zip(rates["prediction"], rates["none"], strict=True)]
    mean = {mode: sum(v) / len(v) for mode, v in rates.items()}
    print("| mode | tokens/s | drafts kept a round | speed-up (rounds) | same tokens |")
    print("|---|---|---|---|---|")
    for mode in ("none", "prediction"):
        cells = ", ".join(f"{v:.1f}" for v in rates[mode])
        speed = f"{mean[mode] / mean['none']:.3f}x"
        if mode != "none":
            speed += f" ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"| {mode} | {cells} | {kept[mode] // args.rounds} | {speed} | {same} |")


if __name__ == "__main__":
    main()
