"""Speculation off against on, one trace, in one process, step by step.

`python -m research.speculation_ab --trace T [--max-num-seqs 1] [--rounds 3] [--model smollm2-135m]
 [--threads 2] [--speculative auto] [--pairing lockstep|runs] [--output ab.json]`

The weights are loaded once; each round runs the whole trace through `bench offline`'s
continuous-batching run (all requests at t=0, exact output lengths) with `--speculative none`
and with `--speculative MODE`, who goes first flipping every round. On a machine whose speed
moves by tens of percent between processes and from minute to minute, runs in separate
processes compare little. `--pairing lockstep` (the default) has the two engines take steps in
turn, each timed by its own steps only (bench.offline.TraceRun), so a drift in the machine's
speed falls on both within milliseconds: on a 2-core Zen 4, mixed-64's rounds agreed within 2%
this way against 0.81-1.11 for whole runs one after the other (`--pairing runs`, the earlier
way; a GPU's second engine would size its KV pool by what the first left free, so there set
`--kv-cache-memory` or pair by runs). Reports tokens/s
per run, the speed-up (ratio of the means, and the range of the rounds' own ratios), the drafts
kept, tokens a step (one request at a time: one sequence's), the seconds the last 25% of the
tokens took, and whether both modes gave the same tokens (greedy: they must).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.baselines import RunResult
from bench.offline import TraceRun
from bench.trace import TraceRequest
from engine.config import EngineConfig
from engine.models.model_loader import LoadedModel

OFF = "none"
# How a round pairs its two runs: steps in turn, or one whole run after the other.
PAIRINGS = ("lockstep", "runs")


@dataclass(frozen=True, slots=True)
class ModeSummary:
    """One mode's runs, in round order."""

    mode: str
    tokens_per_s: list[float]
    kept: float | None  # drafts kept, all rounds together (None: nothing drafted)
    tokens_per_step: float
    tail_s: float  # mean over the rounds
    # What the engine priced a draft row at when each run ended, as a share of a one-row step
    # (measured from its own steps unless --speculative-draft-row-cost fixed it).
    row_costs: list[float]
    # Seconds in prefill steps, plain decode steps and decode steps with drafts (means over
    # the rounds; TraceRun's time_split_s).
    time_split_s: dict[str, float]

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
    pairing: str = "lockstep",
    stop_at_eos: bool = False,
) -> ABReport:
    """`rounds` runs of the trace with speculation off and with `mode`, paired by `pairing`;
    `stop_at_eos`: each reply also ends at its first EOS (else at exactly its output length)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    check_pairing(config, pairing)
    runs: dict[str, list[RunResult]] = {OFF: [], mode: []}
    for r in range(rounds):
        order = (OFF, mode) if r % 2 == 0 else (mode, OFF)
        configs = [config.replace_flat(speculative=m) for m in order]
        if pairing == "lockstep":
            in_turn = [TraceRun(c, loaded, requests, stop_at_eos=stop_at_eos) for c in configs]
            run_in_turn(in_turn)
            results = [run.result() for run in in_turn]
        else:
            results = [
                TraceRun(c, loaded, requests, stop_at_eos=stop_at_eos).run_to_end() for c in configs
            ]
        for m, result in zip(order, results, strict=True):
            runs[m].append(result)
            say(f"round {r + 1} --speculative {m}: {result.tokens_per_s:.1f} tokens/s")
    same = all(a.outputs == b.outputs for a, b in zip(runs[OFF], runs[mode], strict=True))
    return ABReport(summarize_mode(OFF, runs[OFF]), summarize_mode(mode, runs[mode]), same)


def check_pairing(config: EngineConfig, pairing: str) -> None:
    """Refuse a pairing that would not compare like with like."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    if pairing == "lockstep" and config.torch_device.type == "cuda" and not config.kv_cache_memory:
        raise ValueError(
            "lockstep on a GPU needs --kv-cache-memory: otherwise the second engine's KV pool "
            "is sized by what the first left free (or use --pairing runs)"
        )


def run_in_turn(runs: Sequence[TraceRun]) -> None:
    """Steps the runs one each in turn (in order; one that is done drops out) until all are done."""
    while not all(run.done for run in runs):
        for run in runs:
            if not run.done:
                run.step()


def summarize_mode(mode: str, runs: list[RunResult]) -> ModeSummary:
    """One mode's runs, in round order, summed up."""
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
        row_costs=[r.extra["spec_row_cost"] for r in runs],
        time_split_s={
            part: sum(r.extra["time_split_s"][part] for r in runs) / len(runs)
            for part in runs[0].extra["time_split_s"]
        },
    )


def format_time_split(report: ABReport) -> str:
    """Where each mode's steps spent their time (means): prompts cost both modes alike, and
    only the decode steps that verified drafts can buy back the plain ones."""

    def split(s: ModeSummary) -> str:
        return " / ".join(f"{seconds:.2f}" for seconds in s.time_split_s.values())

    return (
        "seconds in prefill steps / decode steps without drafts / with drafts (means): "
        f"off {split(report.off)}, on {split(report.on)}"
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


def summary_json(s: ModeSummary) -> dict[str, Any]:
    return {
        "mode": s.mode,
        "tokens_per_s": s.tokens_per_s,
        "kept": s.kept,
        "tokens_per_step": s.tokens_per_step,
        "tail_s": s.tail_s,
        "row_costs": s.row_costs,
        "time_split_s": s.time_split_s,
    }


def to_json(report: ABReport, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "off": summary_json(report.off),
        "on": summary_json(report.on),
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
        "--no-prompt-lookup-resume",
        action="store_true",
        help="only the tail's own n-grams (the engine's --no-prompt-lookup-resume)",
    )
    p.add_argument(
        "--speculative-history-tokens",
        type=int,
        default=None,
        help="finished replies' tokens looked up too (default: the engine's; 0: own text only)",
    )
    p.add_argument(
        "--speculative-draft-row-cost",
        type=float,
        default=None,
        help="fixes a draft row's cost (default: the engine measures it)",
    )
    p.add_argument(
        "--kv-cache-memory", default=None, help="each engine's KV pool (default: 1 GiB on CPU)"
    )
    p.add_argument(
        "--activation-digits",
        type=int,
        default=None,
        help="the CPU kernels' int8 digits per activation, both engines (default: the engine's)",
    )
    p.add_argument("--limit", type=int, default=None, help="the trace's first N requests")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--pairing",
        choices=PAIRINGS,
        default="lockstep",
        help="lockstep: the two engines take steps in turn, each timed by its own; runs: one "
        "whole run after the other",
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="each reply also ends at its first EOS, as a user's does (default: every request "
        "makes exactly its output length, the same work in both modes)",
    )
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
            "speculative_history_tokens",
            "speculative_draft_row_cost",
            "kv_cache_memory",
            "activation_digits",
        )
        if (value := getattr(args, name)) is not None
    }
    if args.no_prompt_lookup_resume:
        overrides["prompt_lookup_resume"] = False
    try:
        config = config.replace_flat(**overrides)
        check_pairing(config, args.pairing)
    except ValueError as e:
        p.error(str(e))
    loaded = load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    report = run_ab(
        config, loaded, requests, args.speculative, args.rounds, say, args.pairing, args.stop_at_eos
    )
    print(TABLE_HEADER)
    print(format_row(args.label or args.trace, report, args.max_num_seqs == 1))
    print(f"same tokens with and without speculation: {report.same_tokens}")
    costs = ", ".join(f"{c:.3f}" for c in report.on.row_costs)
    print(f"a draft row priced at (share of a one-row step, by round): {costs}")
    print(format_time_split(report))
    if args.output:
        Path(args.output).write_text(json.dumps(to_json(report, vars(args)), indent=2))


if __name__ == "__main__":
    main()
