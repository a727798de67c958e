"""Speculation off against on, one trace, in one process, run after run.

`python -m bench.speculation_ab --trace T [--max-num-seqs 1] [--rounds 3] [--model smollm2-135m]
 [--threads 2] [--speculative auto] [--output ab.json]`

The weights are loaded once; each round runs the whole trace through `bench offline`'s
continuous-batching run (all requests at t=0, exact output lengths) with `--speculative none`
and with `--speculative MODE`, the order flipping every round. On a machine whose speed moves
by tens of percent between processes and from minute to minute, runs in separate processes
compare little; runs seconds apart in one process, paired round by round, do. Reports tokens/s
per run, the speed-up (ratio of the means, and the range of the rounds' own ratios), the drafts
kept, tokens a step (one request at a time: one sequence's), the seconds the last 25% of the
tokens took, and whether both modes gave the same tokens (greedy: they must).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.baselines import RunResult
from bench.offline import run_jitney
from bench.trace import TraceRequest
from engine.config import EngineConfig
from engine.models.model_loader import LoadedModel

OFF = "none"


@dataclass(frozen=True, slots=True)
class ModeSummary:
    """One mode's runs, in round order."""

    mode: str
    tokens_per_s: list[float]
    kept: float | None  # drafts kept, all rounds together (None: nothing drafted)
    tokens_per_step: float
    tail_s: float  # mean over the rounds

    @property
    def mean_tokens_per_s(self) -> float:
        return sum(self.tokens_per_s) / len(self.tokens_per_s)


@dataclass(frozen=True, slots=True)
class ABReport:
    off: ModeSummary
    on: ModeSummary
    same_tokens: bool

    @property
    def speed_up(self) -> float:
        return self.on.mean_tokens_per_s / self.off.mean_tokens_per_s

    @property
    def round_speed_ups(self) -> list[float]:
        return [b / a for a, b in zip(self.off.tokens_per_s, self.on.tokens_per_s, strict=True)]


def run_ab(
    config: EngineConfig,
    loaded: LoadedModel,
    requests: Sequence[TraceRequest],
    mode: str,
    rounds: int,
    say: Callable[[str], None] = lambda _: None,
) -> ABReport:
    """`rounds` runs of the trace with speculation off and with `mode`, interleaved."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    runs: dict[str, list[RunResult]] = {OFF: [], mode: []}
    for r in range(rounds):
        for m in (OFF, mode) if r % 2 == 0 else (mode, OFF):
            result = run_jitney(replace(config, speculative=m), loaded, requests)
            runs[m].append(result)
            say(f"round {r + 1} --speculative {m}: {result.tokens_per_s:.1f} tokens/s")
    same = all(a.outputs == b.outputs for a, b in zip(runs[OFF], runs[mode], strict=True))
    return ABReport(_summary(OFF, runs[OFF]), _summary(mode, runs[mode]), same)


def _summary(mode: str, runs: list[RunResult]) -> ModeSummary:
    drafted = sum(r.extra["spec_draft_tokens"] for r in runs)
    kept = sum(r.extra["spec_accepted_tokens"] for r in runs)
    tokens = sum(r.num_output_tokens for r in runs)
    steps = sum(r.extra["steps"] for r in runs)
    return ModeSummary(
        mode=mode,
        tokens_per_s=[r.tokens_per_s for r in runs],
        kept=kept / drafted if drafted else None,
        tokens_per_step=tokens / steps if steps else 0.0,
        tail_s=sum(r.extra["tail_s"] for r in runs) / len(runs),
    )


def format_row(label: str, report: ABReport, one_at_a_time: bool) -> str:
    """A markdown table row: tokens/s off and on per round, speed-up of the means (the rounds'
    own range), drafts kept, tokens a step (one request at a time only: else a step holds many
    sequences' tokens), the last 25% of tokens (off / on)."""
    lo, hi = min(report.round_speed_ups), max(report.round_speed_ups)
    kept = "-" if report.on.kept is None else f"{100 * report.on.kept:.0f}%"
    step = f"{report.on.tokens_per_step:.2f}" if one_at_a_time else "-"
    return (
        f"| {label} | {', '.join(f'{x:.1f}' for x in report.off.tokens_per_s)} | "
        f"{', '.join(f'{x:.1f}' for x in report.on.tokens_per_s)} | "
        f"{report.speed_up:.2f}x ({lo:.2f}-{hi:.2f}) | {kept} | {step} | "
        f"{report.off.tail_s:.2f} / {report.on.tail_s:.2f} |"
    )


TABLE_HEADER = (
    "| trace | off: tokens/s | on: tokens/s | speed-up (rounds) | drafts kept | tokens a step "
    "| last 25% of tokens, s (off / on) |\n|---|---|---|---|---|---|---|"
)


def to_json(report: ABReport, args: dict[str, Any]) -> dict[str, Any]:
    def mode(s: ModeSummary) -> dict[str, Any]:
        return {
            "mode": s.mode,
            "tokens_per_s": s.tokens_per_s,
            "kept": s.kept,
            "tokens_per_step": s.tokens_per_step,
            "tail_s": s.tail_s,
        }

    return {
        "off": mode(report.off),
        "on": mode(report.on),
        "speed_up": report.speed_up,
        "round_speed_ups": report.round_speed_ups,
        "same_tokens": report.same_tokens,
        "args": args,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="bench/traces/quoting.json")
    p.add_argument("--label", default=None, help="the table row's name (default: the trace)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--speculative", default="auto", help="the mode compared with none")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="default: the engine's")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="default: the engine's")
    p.add_argument(
        "--speculative-draft-row-cost",
        type=float,
        default=None,
        help="fixes a draft row's cost (default: the engine measures it)",
    )
    p.add_argument("--limit", type=int, default=None, help="the trace's first N requests")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="also write the result here as JSON")
    args = p.parse_args(argv)
    if args.speculative == OFF:
        p.error("--speculative: the mode to compare with none")
    import torch

    from bench.trace import load_trace
    from engine.models.model_loader import load_model

    torch.set_num_threads(args.threads)
    requests = load_trace(args.trace, args.limit)
    config = EngineConfig(model=args.model)
    overrides = {
        name: value
        for name in (
            "max_num_seqs",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "speculative_draft_row_cost",
        )
        if (value := getattr(args, name)) is not None
    }
    try:
        config = replace(config, **overrides)
    except ValueError as e:
        p.error(str(e))
    loaded = load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    report = run_ab(config, loaded, requests, args.speculative, args.rounds, say)
    print(TABLE_HEADER)
    print(format_row(args.label or args.trace, report, args.max_num_seqs == 1))
    print(f"same tokens with and without speculation: {report.same_tokens}")
    if args.output:
        Path(args.output).write_text(json.dumps(to_json(report, vars(args)), indent=2))


if __name__ == "__main__":
    main()
