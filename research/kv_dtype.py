"""What the KV cache's dtype does to one user's decode at long contexts: ms per token, interleaved.

`python -m research.kv_dtype [--dtypes float32,float16,bfloat16] [--contexts 256,1024,2048,4000]
 [--tokens 64] [--rounds 2] [--speculative none] [--output kv_dtype.json]`

One engine per `--kv-cache-dtype`, all loaded at once; each round runs every context on every
engine in turn (a warm-up round first, not counted), so a machine whose speed drifts moves every
dtype alike. The prompt is the first `context` tokens of Python's language-reference prose (as
research/perplexity.py's); the request is greedy, ignores EOS, and its decode steps are timed from
the first token on (the prefill is not). Ratios are against the first dtype, in the same run.
Where the time goes: a decode step reads every K/V of its context once (SmolLM2: 46 KB a token in
float32), beside the weights, so past a few hundred positions that read is what a 16-bit pool
halves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Timing:
    dtype: str
    context: int
    ms_per_token: list[float]  # one per counted round

    @property
    def median(self) -> float:
        return statistics.median(self.ms_per_token)


@dataclass(frozen=True, slots=True)
class Decode:
    """One request's decode steps after its first token, timed."""

    seconds: float  # from the first token to the last step's end
    tokens: int
    # The step that ends the last request also checks the idle pool, O(its blocks): timed on its
    # own by the engine (Engine.last_idle_check_s) and no part of decoding.
    idle_check_s: float

    @property
    def ms_per_token(self) -> float:
        return (self.seconds - self.idle_check_s) * 1000 / self.tokens


def decode(engine, prompt: list[int], tokens: int) -> Decode:
    """One greedy request of `tokens` tokens (EOS ignored) to its end, its decode timed."""
    from generation.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.add_request("kv-dtype", prompt, params)
    produced, start = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            if start is None and out.new_token_ids:
                start, produced = time.perf_counter(), -len(out.new_token_ids)
            produced += len(out.new_token_ids)
    assert start is not None and produced > 0
    return Decode(time.perf_counter() - start, produced, engine.last_idle_check_s)


def run(
    model: str,
    dtypes: list[str],
    contexts: list[int],
    tokens: int,
    rounds: int,
    speculative: str = "none",
    kv_cache_memory: str = "2GiB",
) -> list[Timing]:
    from engine.config import EngineConfig
    from engine.llm_engine import Engine
    from engine.models.model_loader import load_model
    from engine.speculative_options import SpeculativeOptions
    from research.perplexity import reference_text

    loaded = load_model(model)  # one copy of the weights; each engine its own pool
    engines = {
        d: Engine(
            EngineConfig(
                model=model,
                kv_cache_dtype=d,
                speculative=SpeculativeOptions(speculative),
                max_num_seqs=1,
                kv_cache_memory=kv_cache_memory,
                enable_prefix_caching=False,
            ),
            loaded=loaded,
        )
        for d in dtypes
    }
    ids = loaded.tokenizer(reference_text(), add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < max(contexts):
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {max(contexts)}")
    times: dict[tuple[str, int], list[float]] = {(d, c): [] for d in dtypes for c in contexts}
    for r in range(rounds + 1):
        for c in contexts:
            for d in dtypes:
                ms = decode(engines[d], ids[:c], tokens).ms_per_token
                if r:  # round 0 warms every path up
                    times[(d, c)].append(ms)
    return [Timing(d, c, times[(d, c)]) for c in contexts for d in dtypes]


def table(timings: list[Timing]) -> str:
    dtypes = list(dict.fromkeys(t.dtype for t in timings))
    by = {(t.dtype, t.context): t for t in timings}
    head = "| context | " + " | ".join(f"{d} ms/token" for d in dtypes)
    head += " | " + " | ".join(f"{dtypes[0]} / {d}" for d in dtypes[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(dtypes) - 1)]
    for c in dict.fromkeys(t.context for t in timings):
        base = by[(dtypes[0], c)].median
        cells = [" / ".join(f"{x:.2f}" for x in by[(d, c)].ms_per_token) for d in dtypes]
        ratios = [f"{base / by[(d, c)].median:.2f}x" for d in dtypes[1:]]
        lines.append(f"| {c} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--contexts", default="256,1024,2048,4000")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="counted rounds, after one warm-up")
    p.add_argument("--speculative", default="none")
    p.add_argument("--kv-cache-memory", default="2GiB", help="each engine's pool")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="also write the timings here as JSON")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1:
        p.error("--tokens must be at least 2 and --rounds at least 1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    try:
        timings = run(
            args.model,
            args.dtypes.split(","),
            contexts,
            args.tokens,
            args.rounds,
            args.speculative,
            args.kv_cache_memory,
        )
    except ValueError as e:
        p.error(str(e))
    print(table(timings))
    if args.output:
        report = {"timings": [asdict(t) for t in timings], "args": vars(args)}
        Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
