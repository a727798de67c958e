"""Greedy text of the default forward (a GGUF file's own blocks) against the exact mode on the
same weights (`--quantization none`: the file dequantized), under the near-tie rule.

`python -m bench.greedy_agreement --model FILE.gguf [--max-tokens 32]`

Each short prompt (plain text, so a base model takes it too) is decoded greedily by both, EOS
ignored. A prompt passes when the tokens are equal, or leave the exact mode's at a near-tie and
from there on are each the exact model's argmax or within NEAR_TIE of it, teacher-forced
(bench/parity.py): quantized activations may flip a token whose two candidates are that close.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.parity import greedy_parity_failure
from engine.config import ACTIVATION_DIGITS, EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from generation.sampling_params import SamplingParams

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "To make a cup of tea, first",
    "In 1969, the first humans",
    "The quick brown fox",
    "Photosynthesis is the process by which",
)


def compare(model: str, max_tokens: int, **settings: object) -> dict:
    """Both modes' greedy tokens on PROMPTS, and the verdict per prompt; `settings`: further
    EngineConfig fields (the KV budget, say)."""
    loaded = load_model(model)
    tokenizer = loaded.tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("auto", "none"):
        engine = Engine(
            EngineConfig.from_flat(model=model, quantization=mode, speculative="none", **settings),
            loaded,
        )
        runs[mode] = [r.token_ids for r in engine.generate(prompts, params)]
    rows = []
    for text, prompt, got, want in zip(PROMPTS, prompts, runs["auto"], runs["none"], strict=True):
        failure = greedy_parity_failure(loaded, prompt, got, want)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        rows.append(
            {"prompt": text, "equal": first is None, "first_diff": first, "failure": failure}
        )
    return {
        "model": model,
        "max_tokens": max_tokens,
        "equal": sum(r["equal"] for r in rows),
        "passed": sum(r["failure"] is None for r in rows),
        "prompts": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--activation-digits",
        type=int,
        choices=ACTIVATION_DIGITS,
        default=2,
        help="the default forward's int8 digits per activation (--activation-digits)",
    )
    p.add_argument("--output", help="results JSON")
    args = p.parse_args()
    report = compare(args.model, args.max_tokens, activation_digits=args.activation_digits)
    for r in report["prompts"]:
        verdict = "equal" if r["equal"] else f"differs at {r['first_diff']}"
        ok = "ok" if r["failure"] is None else "FAIL"
        print(f"{verdict:>16}  {ok:>4}  {r['prompt']!r}")
        if r["failure"]:
            print(f"                  {r['failure']}")
    n = len(report["prompts"])
    print(f"{report['equal']}/{n} equal, {report['passed']}/{n} within the near-tie rule")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if report["passed"] == n else 1)


if __name__ == "__main__":
    main()
