"""Speculation off and several engine settings, one trace, in one process, step by step.

`python -m research.speculation_variants --trace T --variant NAME:FIELD=VALUE[,FIELD=VALUE...]
 [--variant ...] [--max-num-seqs 1] [--rounds 6] [--model smollm2-135m] [--output v.json]`

research.speculation_ab pairs off with one mode; tuning a proposer or the policy compares two
settings that differ by a few percent, less than this machine drifts between runs. Here every
variant (engine settings on top of the defaults, named as the flags name them: EngineConfig's
fields, the speculative ones flat; `NAME:` alone being the defaults) and
speculation off run the trace in lockstep (research.speculation_ab.run_in_turn: the engines take
steps in turn, each timed by its own steps), who goes first rotating every round. Reports each
round's tokens/s and speed-up over off, and per variant the speed-up of the means (the rounds'
range), drafts kept, tokens a step, where its steps spent their time, and whether its tokens
are off's (greedy: they must be).

  python -m research.speculation_variants --trace bench/traces/quoting.json --max-num-seqs 1 \\
    --variant without:prompt_lookup_resume=false --variant with: --rounds 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.baselines import RunResult
from bench.offline import TraceRun
from bench.trace import TraceRequest
from engine.config import EngineConfig
from engine.models.model_loader import LoadedModel
from engine.speculative_options import FLAT_FIELDS, SpeculativeOptions
from research.speculation_ab import ModeSummary, run_in_turn, summarize_mode, summary_json

OFF = "off"
# Fields the weights were loaded with, once for every variant.
LOAD_FIELDS = ("model", "device", "dtype", "cache_dir")


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    settings: dict[str, Any]  # settings on top of the base config, flat (EngineConfig.from_flat)


@dataclass(frozen=True, slots=True)
class VariantsReport:
    summaries: dict[str, ModeSummary]  # OFF first, then the variants in the order given
    same_tokens: dict[str, bool]  # variant -> its outputs were off's in every round

    def speed_ups(self, name: str) -> list[float]:
        """`name`'s tokens/s over off's, by round."""
        off = self.summaries[OFF].tokens_per_s
        return [v / o for o, v in zip(off, self.summaries[name].tokens_per_s, strict=True)]

    def speed_up(self, name: str) -> float:
        """The ratio of the means."""
        return self.summaries[name].mean_tokens_per_s / self.summaries[OFF].mean_tokens_per_s


def parse_variant(text: str) -> Variant:
    """`NAME:FIELD=VALUE,...` into a Variant whose values have their setting's type (`none` for
    an optional field's None, `true`/`false` for a switch)."""
    name, sep, rest = text.partition(":")
    if not sep or not name or name == OFF:
        raise ValueError(f"a variant is NAME:FIELD=VALUE,... (NAME not {OFF!r}), got {text!r}")
    hints = _flat_hints()
    settings: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        field, eq, value = item.partition("=")
        if not eq or field not in hints:
            raise ValueError(f"variant {name}: {item!r} is not FIELD=VALUE of an engine field")
        if field in LOAD_FIELDS:
            raise ValueError(
                f"variant {name}: the weights are loaded once; {field} is not a variant's"
            )
        settings[field] = _typed(value, hints[field], f"variant {name}: {field}")
    return Variant(name, settings)


def _flat_hints() -> dict[str, Any]:
    """Each engine setting's type by its flat name (the speculative ones as FLAT_FIELDS names)."""
    engine = typing.get_type_hints(EngineConfig)
    speculative = typing.get_type_hints(SpeculativeOptions)
    flat = {name: speculative[field] for name, field in FLAT_FIELDS.items()}
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"speculative"}
    return {**{name: engine[name] for name in fields}, **flat}


def _typed(value: str, hint: Any, where: str) -> Any:
    """`value` as `hint`'s type: bool, int, float, str, or one of them | None."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value.lower() == "none" and type(None) in options:
        return None
    kind = next((t for t in options if t is not type(None)), str)
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{where}: true or false, got {value!r}")
        return value.lower() == "true"
    try:
        return kind(value) if kind in (int, float, str) else value
    except ValueError:
        raise ValueError(f"{where}: expected {kind.__name__}, got {value!r}") from None


def check_variants(config: EngineConfig, variants: Sequence[Variant], rounds: int) -> None:
    """Refuse what would not run (each variant's config validates itself) before any weights
    load."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    names = [v.name for v in variants]
    if not names or len(set(names)) != len(names):
        raise ValueError("at least one variant is needed, and each its own name")
    for v in variants:
        config.replace_flat(**v.settings)


def run_variants(
    config: EngineConfig,
    loaded: LoadedModel,
    requests: Sequence[TraceRequest],
    variants: Sequence[Variant],
    rounds: int,
    say: Callable[[str], None] = lambda _: None,
) -> VariantsReport:
    """`rounds` lockstep runs of the trace with speculation off and with each variant."""
    check_variants(config, variants, rounds)
    names = [OFF, *(v.name for v in variants)]
    configs = {OFF: config.replace_flat(speculative="none")}
    configs |= {v.name: config.replace_flat(**v.settings) for v in variants}
    runs: dict[str, list[RunResult]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        in_turn = {name: TraceRun(configs[name], loaded, requests) for name in order}
        run_in_turn(list(in_turn.values()))
        for name in order:
            runs[name].append(in_turn[name].result())
        off = runs[OFF][-1].tokens_per_s
        say(
            f"round {r + 1} ({', '.join(order)}): "
            + ", ".join(f"{n} {runs[n][-1].tokens_per_s / off:.3f}x" for n in names[1:])
        )
    same = {
        n: all(a.outputs == b.outputs for a, b in zip(runs[OFF], runs[n], strict=True))
        for n in names[1:]
    }
    return VariantsReport({n: summarize_mode(n, runs[n]) for n in names}, same)


def format_report(report: VariantsReport, one_at_a_time: bool) -> str:
    """A markdown table, one row per mode, and whether each variant's tokens were off's."""
    lines = [
        "| variant | tokens/s | speed-up (rounds) | drafts kept | tokens a step | seconds in "
        "prefill / plain decode / drafted decode (means) | same tokens as off |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in report.summaries.items():
        ups = report.speed_ups(name)
        speed_up = f"{report.speed_up(name):.3f}x ({min(ups):.3f}-{max(ups):.3f})"
        kept = "-" if s.kept is None else f"{100 * s.kept:.0f}%"
        step = f"{s.tokens_per_step:.2f}" if one_at_a_time else "-"
        split = " / ".join(f"{seconds:.2f}" for seconds in s.time_split_s.values())
        same = "-" if name == OFF else str(report.same_tokens[name])
        lines.append(
            f"| {name} | {', '.join(f'{x:.1f}' for x in s.tokens_per_s)} | {speed_up} | {kept} "
            f"| {step} | {split} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="bench/traces/quoting.json")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--variant",
        action="append",
        required=True,
        help="NAME:FIELD=VALUE,... engine settings on top of the defaults (NAME: alone: the "
        "defaults); repeat for each variant",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory", default=None, help="each engine's KV pool (default: 1 GiB on CPU)"
    )
    p.add_argument("--limit", type=int, default=None, help="the trace's first N requests")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="also write the result here as JSON")
    args = p.parse_args(argv)
    import torch

    from bench.trace import load_trace
    from engine.models.model_loader import load_model

    try:
        variants = [parse_variant(v) for v in args.variant]
        config = EngineConfig(model=args.model)
        overrides = {
            name: value
            for name in ("max_num_seqs", "kv_cache_memory")
            if (value := getattr(args, name)) is not None
        }
        config = replace(config, **overrides)
        check_variants(config, variants, args.rounds)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    requests = load_trace(args.trace, args.limit)
    loaded = load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    report = run_variants(config, loaded, requests, variants, args.rounds, say)
    print(format_report(report, args.max_num_seqs == 1))
    if args.output:
        result = {
            "modes": {n: summary_json(s) for n, s in report.summaries.items()},
            "speed_ups": {n: report.speed_up(n) for n in report.summaries},
            "round_speed_ups": {n: report.speed_ups(n) for n in report.summaries},
            "same_tokens": report.same_tokens,
            "variants": {v.name: v.settings for v in variants},
            "args": vars(args),
        }
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
