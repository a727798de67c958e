"""Two or more kernel levels on one trace, in one process, interleaved request by request.

`python -m research.isa_ab [--trace bench/traces/quoting.json] [--levels avx2,avx2-int16]
 [--speculative ngram] [--rounds 2] [--model smollm2-135m] [--threads 2] [--output ab.json]`

Each request of the trace runs alone (one user), greedy, its trace's output length, once per
level in turn (the order flips every round), after one warm-up request; the engine and its
weights are loaded once and only the kernels' level changes between requests (`set_isa`). On a
machine whose speed drifts by tens of percent from minute to minute, two `bench offline` runs
minutes apart compare little; requests a second apart, in one process, do. It reports tokens/s
per level and whether every level gave the same tokens (levels that round activations
differently may part where two candidates nearly tie).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LevelRun:
    level: str
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass(frozen=True, slots=True)
class ABResult:
    runs: list[LevelRun]
    same_tokens: bool


def run_ab(engine, requests: Sequence[dict], levels: Sequence[str], rounds: int) -> ABResult:
    """Each request alone, once per level per round; levels the CPU lacks are refused."""
    from engine.kernels import kernel_backend
    from generation.sampling_params import SamplingParams

    backend = kernel_backend()
    missing = [lv for lv in levels if lv not in backend.available_isas()]
    if missing:
        raise ValueError(f"levels {missing} not on this CPU: {backend.available_isas()}")
    before = backend.isa
    tokens = dict.fromkeys(levels, 0)
    seconds = dict.fromkeys(levels, 0.0)
    outputs: dict[tuple[int, str], list[int]] = {}
    try:
        first = requests[0]
        engine.generate([first["prompt_ids"]], [SamplingParams(max_tokens=8, temperature=0)])
        for r in range(rounds):
            for i, req in enumerate(requests):
                params = SamplingParams(
                    max_tokens=req["output_len"], temperature=0, ignore_eos=True
                )
                for level in levels if r % 2 == 0 else list(reversed(levels)):
                    assert backend.set_isa(level) == level
                    start = time.perf_counter()
                    done = engine.generate([req["prompt_ids"]], [params])[0]
                    seconds[level] += time.perf_counter() - start
                    tokens[level] += len(done.token_ids)
                    outputs.setdefault((i, level), list(done.token_ids))
    finally:
        backend.set_isa(before)
    same = all(
        outputs[(i, level)] == outputs[(i, levels[0])]
        for i in range(len(requests))
        for level in levels
    )
    runs = [LevelRun(lv, tokens[lv], seconds[lv]) for lv in levels]
    return ABResult(runs, same)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="bench/traces/quoting.json")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--levels", default="avx2,avx2-int16", help="comma-separated kernel levels")
    p.add_argument("--speculative", default="ngram")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="also write the result here as JSON")
    args = p.parse_args(argv)
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import Engine
    from engine.speculative_options import SpeculativeOptions

    torch.set_num_threads(args.threads)
    requests = json.loads(Path(args.trace).read_text())["requests"]
    engine = Engine(
        EngineConfig(
            model=args.model,
            speculative=SpeculativeOptions(args.speculative),
            quantization=args.quantization,
            max_num_seqs=1,
        )
    )
    result = run_ab(engine, requests, args.levels.split(","), args.rounds)
    print(f"{len(requests)} requests x {args.rounds} rounds, --speculative {args.speculative}")
    for run in result.runs:
        print(
            f"{run.level:>12}  {run.tokens_per_s:7.1f} tokens/s"
            f"  ({run.tokens} in {run.seconds:.1f} s)"
        )
    print(f"same tokens at every level: {result.same_tokens}")
    if args.output:
        report = {
            "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in result.runs],
            "same_tokens": result.same_tokens,
            "args": vars(args),
        }
        Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
