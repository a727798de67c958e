"""`jitney bench offline`: our engine vs transformers' baselines on one trace, in one run.

Every request arrives at t=0 and generates exactly its `output_len` tokens (EOS ignored), so every
system does the same useful work; the table reports each policy's ratio to each baseline measured
in the same process, on the same machine, moments apart. A second table splits each policy's mean
step into its phases (engine/step_timing.py) and the overhead around the forward; the
zero-overhead baseline (bench/zero_overhead.py) is the ceiling: forwards only.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.baselines import HF_CB, HF_GENERATE, RunResult, best_hf_cb, run_hf_generate
from bench.trace import TraceRequest
from bench.zero_overhead import ZERO_OVERHEAD, run_zero_overhead
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel
from engine.step_timing import PHASES, StepTiming
from generation.sampling_params import SamplingParams

BASELINES = (HF_GENERATE, HF_CB, ZERO_OVERHEAD)
# The phase table's columns after the engine's phases: the step as timed around Engine.step,
# and its overhead (the step minus the forward).
STEP, OVERHEAD = "step", "overhead"
# What the report says of the warm-up each run takes before its clock starts.
WARMUP_NOTE = (
    "each run warms up on one 2-token request whose prompt is not in the trace (the first "
    "request's length, its first token one that starts no request), so no trace prompt starts "
    "in the prefix cache"
)


class OfflineBenchError(ValueError):
    """The run cannot start as asked (a trace the model cannot read, an unknown baseline)."""


@dataclass(frozen=True, slots=True)
class StructuredRun:
    """--response-format: each policy runs again with every request constrained to `grammar`."""

    label: str  # json_object, json_schema, regex
    grammar: str  # llguidance grammar (generation.grammar)


class TraceRun:
    """One engine running a trace with `config.batching`, all requests at t=0, a step at a time
    (`step`, or `run_to_end`), then its RunResult. `detokenize=False` runs the engine as a
    worker does: token ids out, the text left to the gateway, so the step is what a served step
    costs. `structured`: every request constrained to its grammar (a request ends early when its
    grammar is complete). `stop_at_eos`: a request also ends at its first EOS, as a user's reply
    does (else it makes exactly its `output_len` tokens).

    Its clock counts only the time spent in its own steps (and in adding the requests): for a
    run alone that is its wall time; for runs that take steps in turn (research.speculation_ab's
    lockstep), each is timed as if the machine were its own, while a drift in the machine's
    speed falls on both alike."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        requests: Sequence[TraceRequest],
        warmup: bool = True,
        detokenize: bool = True,
        structured: StructuredRun | None = None,
        stop_at_eos: bool = False,
        loras: Sequence[str | None] | None = None,
    ) -> None:
        """`loras`: the LoRA adapter each request runs under (None: the base model's)."""
        self.config, self.detokenize, self.structured = config, detokenize, structured
        self.engine = engine = Engine(config, loaded=loaded)
        if warmup and requests:
            prompt = warmup_prompt(requests)
            engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
        # The warm-up's own prefix-cache hits are not the run's.
        self.prefix_hits_before = engine.stats.num_prefix_hits_total
        started = time.perf_counter()
        self.outputs: dict[str, list[int]] = {}
        grammar = None if structured is None else structured.grammar
        loras = loras or [None] * len(requests)
        for r, lora in zip(requests, loras, strict=True):
            params = SamplingParams(
                max_tokens=r.output_len,
                temperature=0,
                ignore_eos=not stop_at_eos,
                detokenize=detokenize,
                grammar=grammar,
            )
            engine.add_request(
                r.request_id, r.prompt_ids, params, arrival_time=time.monotonic(), lora=lora
            )
            self.outputs[r.request_id] = []
        engine.flush()
        self.elapsed = time.perf_counter() - started  # the run's own clock, in seconds
        self.ttft: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}
        self.ended_by_grammar = self.steps = self.peak_blocks = 0
        self.phases, self.step_s = StepTiming(), 0.0
        self.made: list[tuple[float, int]] = []  # (own seconds, tokens so far) after each step
        self.made_total = 0
        self.by_drafts: dict[int, DraftSteps] = {}
        self.prefill_s = 0.0  # in steps with a prefill chunk (the rest: by_drafts)

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def run_to_end(self) -> RunResult:
        # As `jitney worker` runs: what start-up built is out of the collector's generations, so
        # no full collection walks the model's objects mid-run (1-2% of a mixed trace's samples,
        # perf); given back after, so a bench of several engines still frees each.
        gc.freeze()
        try:
            while not self.done:
                self.step()
        finally:
            gc.unfreeze()
        return self.result()

    def step(self) -> None:
        engine, stats = self.engine, self.engine.stats
        drafted, accepted = stats.num_draft_tokens_total, stats.num_accepted_tokens_total
        step_start = time.perf_counter()
        step_outputs = engine.step()
        # Less the pool check of the step that left the engine idle (once, not per step).
        seconds = time.perf_counter() - step_start - engine.last_idle_check_s
        self.step_s += seconds
        self.phases.add(engine.last_step_timing)
        drafts = stats.num_draft_tokens_total - drafted
        if stats.num_batched_tokens == stats.batch_size + drafts:  # decodes only, no prefill
            entry = self.by_drafts.setdefault(drafts, DraftSteps())
            kept = stats.num_accepted_tokens_total - accepted
            entry.add(seconds, engine.last_step_timing.forward, kept)
        else:
            self.prefill_s += seconds
        now = self.elapsed + time.perf_counter() - step_start
        for out in step_outputs:
            self.outputs[out.request_id] += out.new_token_ids
            self.made_total += len(out.new_token_ids)
            if out.new_token_ids:
                self.ttft.setdefault(out.request_id, now)
            if out.finished:
                self.finished_at[out.request_id] = now
            self.ended_by_grammar += out.finish_reason == "stop"
        self.steps += 1
        self.peak_blocks = max(self.peak_blocks, engine.view.kv_used_blocks)
        self.elapsed += time.perf_counter() - step_start
        self.made.append((self.elapsed, self.made_total))

    def result(self) -> RunResult:
        engine, stats, config, steps = self.engine, self.engine.stats, self.config, self.steps
        useful, wall = self.made_total, self.elapsed
        suffix = "" if self.structured is None else f"+{self.structured.label}"
        return RunResult(
            name=f"jitney-{config.batching}{suffix}",
            wall_s=wall,
            num_output_tokens=useful,
            latencies_s=self.finished_at,
            ttft_s=self.ttft,
            outputs=self.outputs,
            extra={
                "steps": steps,
                "slot_util": useful / (steps * config.max_num_seqs) if steps else 0.0,
                "preemptions": stats.num_preemptions_total,
                # Prompt tokens the run's requests took from the prefix cache.
                "prefix_cache_hit_tokens": stats.num_prefix_hits_total - self.prefix_hits_before,
                "peak_kv_blocks": self.peak_blocks,
                "kv_blocks_total": engine.view.kv_total_blocks,
                "phase_ms_per_step": _ms_per_step(self.phases, self.step_s, steps),
                "detokenize": self.detokenize,
                "ended_by_grammar": self.ended_by_grammar,
                "decode_attention": engine.decode_attention,
                "cuda_graphs": _graphs_report(engine),
                "tail_s": _tail_s(self.made, wall),
                "spec_draft_tokens": stats.num_draft_tokens_total,
                "spec_accepted_tokens": stats.num_accepted_tokens_total,
                # Of those, proposed from earlier replies (--speculative-history-tokens).
                "spec_history_draft_tokens": stats.num_history_draft_tokens_total,
                "spec_history_accepted_tokens": stats.num_history_accepted_tokens_total,
                "spec_prediction_draft_tokens": stats.num_prediction_draft_tokens_total,
                "spec_prediction_accepted_tokens": stats.num_prediction_accepted_tokens_total,
                "spec_acceptance": (
                    stats.num_accepted_tokens_total / stats.num_draft_tokens_total
                    if stats.num_draft_tokens_total
                    else None
                ),
                # The row cost the policy priced drafts at when the run ended (measured, unless
                # --speculative-draft-row-cost fixed it).
                "spec_row_cost": engine.view.draft_row_cost,
                # Where the steps' time went: prompts (steps with a prefill chunk), decode steps
                # that verified no draft, and those that did (speculation's gain is in the last).
                "time_split_s": {
                    "prefill": self.prefill_s,
                    "plain_decode": self.by_drafts[0].seconds if 0 in self.by_drafts else 0.0,
                    "drafted_decode": sum(e.seconds for d, e in self.by_drafts.items() if d),
                },
                # Decode steps by the drafts they verified (none: no step verified any).
                "steps_by_drafts": (
                    {d: e.summary() for d, e in sorted(self.by_drafts.items())}
                    if any(self.by_drafts.keys() - {0})
                    else None
                ),
            },
        )


def warmup_prompt(requests: Sequence[TraceRequest]) -> list[int]:
    """A prompt for the warm-up that shares no prefix-cache block with any request of the trace:
    the first request's tokens (so the warm-up's shapes are the run's), its first token replaced
    by the smallest id that starts no request. Block hashes are chained from the first block, so
    no block of it can match a trace prompt's. That id is at most the number of distinct first
    tokens, so it is in any vocabulary the trace fits."""
    firsts = {r.prompt_ids[0] for r in requests if r.prompt_ids}
    first = next(t for t in range(len(firsts) + 1) if t not in firsts)
    return [first, *requests[0].prompt_ids[1:]]


@dataclass(slots=True)
class DraftSteps:
    """The decode steps (no prefill chunk) that verified one number of drafts, all sequences'
    together: what a draft row costs on this machine, beside the plain decode steps (0 drafts)
    of the same run."""

    steps: int = 0
    seconds: float = 0.0
    forward_s: float = 0.0
    kept: int = 0

    def add(self, seconds: float, forward_s: float, kept: int) -> None:
        self.steps += 1
        self.seconds += seconds
        self.forward_s += forward_s
        self.kept += kept

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "step_ms": 1e3 * self.seconds / self.steps,
            "forward_ms": 1e3 * self.forward_s / self.steps,
            "kept_per_step": self.kept / self.steps,
        }


def _tail_s(made: list[tuple[float, int]], wall: float) -> float:
    """Seconds the last quarter of the output tokens took (a trace's tail, where few
    sequences are left running)."""
    if not made:
        return 0.0
    total = made[-1][1]
    reached = next(t for t, n in made if n >= 0.75 * total)
    return wall - reached


def _graphs_report(engine: Engine) -> dict[str, Any] | None:
    """How many decode graphs were captured and replayed (None: graphs off)."""
    graphs = engine.view.decode_graphs
    if graphs is None:
        return None
    return {"captured": graphs.num_captured, "steps": graphs.num_steps, "failed": graphs.failed}


def _ms_per_step(phases: StepTiming, step_s: float, steps: int) -> dict[str, float]:
    """Mean milliseconds per step of each phase, of the whole step and of its overhead."""
    ms = {name: 1000 * s / steps if steps else 0.0 for name, s in phases.as_dict().items()}
    ms[STEP] = 1000 * step_s / steps if steps else 0.0
    ms[OVERHEAD] = ms[STEP] - ms["forward"]
    return ms


def run_baseline(
    name: str, loaded: LoadedModel, requests: Sequence[TraceRequest], config: EngineConfig
) -> RunResult:
    if name == HF_GENERATE:
        return run_hf_generate(loaded, requests, batch_size=16)
    if name == HF_CB:
        return best_hf_cb(loaded, requests)
    if name == ZERO_OVERHEAD:
        return run_zero_overhead(loaded, requests, config.max_num_seqs)
    raise OfflineBenchError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")


def check_token_ids(requests: Sequence[TraceRequest], loaded: LoadedModel) -> None:
    """Refuse a trace whose prompt ids the model's vocabulary does not hold (the embedding would
    fail mid-run with an IndexError)."""
    vocab = loaded.vocab_size
    ids = [t for r in requests for t in r.prompt_ids]
    if ids and (max(ids) >= vocab or min(ids) < 0):
        bad = max(ids) if max(ids) >= vocab else min(ids)
        raise OfflineBenchError(
            f"the trace's token ids do not fit {loaded.name}: it holds id {bad}, but the "
            f"vocabulary has {vocab} ids (0..{vocab - 1}); use the model the trace was made for"
        )


def format_table(ours: list[RunResult], baselines: list[RunResult]) -> str:
    header = (
        f"{'system':<20} {'tok/s':>8} {'mean lat':>9} {'p50 lat':>8} {'p99 lat':>8} "
        f"{'mean TTFT':>9} {'slot util':>9} {'preempt':>7} {'peak KV':>8} {'tail 25%':>8} "
        f"{'accept':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in [*ours, *baselines]:
        util = r.extra.get("slot_util", r.extra.get("slot_efficiency"))
        lines.append(
            f"{r.name:<20} {r.tokens_per_s:>8.1f} {r.mean_latency_s:>8.1f}s "
            f"{r.p50_latency_s:>7.1f}s {r.p99_latency_s:>7.1f}s {r.mean_ttft_s:>8.2f}s "
            f"{_pct(util):>9} {r.extra.get('preemptions', '-')!s:>7} "
            f"{r.extra.get('peak_kv_blocks', '-')!s:>8} {_seconds(r.extra.get('tail_s')):>8} "
            f"{_pct(r.extra.get('spec_acceptance')):>6}"
        )
    if baselines:
        lines.append("")
        for r in ours:
            ratios = ", ".join(
                f"{r.tokens_per_s / b.tokens_per_s:.2f}x {b.name}" for b in baselines
            )
            lines.append(f"{r.name}: useful tokens/s = {ratios}")
    return "\n".join(lines)


def format_structured(pairs: list[tuple[RunResult, RunResult]], num_requests: int) -> str:
    """Each policy's constrained run against its free run (same trace, same process)."""
    lines = []
    for free, constrained in pairs:
        free_ms = free.extra["phase_ms_per_step"][STEP]
        ms = constrained.extra["phase_ms_per_step"][STEP]
        lines.append(
            f"{constrained.name}: useful tokens/s = "
            f"{constrained.tokens_per_s / free.tokens_per_s:.2f}x {free.name}; "
            f"{ms:.2f} ms per step vs {free_ms:.2f}; "
            f"{constrained.extra['ended_by_grammar']} of {num_requests} requests ended by "
            "their grammar before output_len"
        )
    return "\n".join(lines)


def format_phase_table(ours: list[RunResult]) -> str:
    """Mean ms per step of each engine phase; `step` is timed around Engine.step, so the phases
    add up to it; `overhead` is the step minus the forward."""
    columns = (*PHASES, STEP, OVERHEAD)
    header = f"{'ms per step':<20} " + " ".join(f"{c:>11}" for c in columns) + f" {'ovh %':>6}"
    lines = [header, "-" * len(header)]
    for r in ours:
        ms = r.extra["phase_ms_per_step"]
        share = ms[OVERHEAD] / ms[STEP] if ms[STEP] else None
        cells = " ".join(f"{ms[c]:>11.3f}" for c in columns)
        lines.append(f"{r.name:<20} {cells} {_pct(share):>6}")
    return "\n".join(lines)


def format_draft_table(ours: list[RunResult]) -> str:
    """Per run that speculated: its decode steps by the drafts they verified, with mean ms per
    step and per forward, and the drafts kept. The steps with 0 drafts are the plain ones a draft
    row's cost is read against (empty: no run speculated)."""
    lines = []
    for r in ours:
        rows = r.extra.get("steps_by_drafts")
        if not rows:
            continue
        lines += [
            f"{r.name}: decode steps by drafts verified (a draft row priced at "
            f"{r.extra['spec_row_cost']:.2f} of a step when the run ended)",
            f"{'drafts':>8} {'steps':>7} {'ms/step':>8} {'forward':>8} {'kept':>6}",
        ]
        for drafts, e in rows.items():
            lines.append(
                f"{drafts:>8} {e['steps']:>7} {e['step_ms']:>8.2f} {e['forward_ms']:>8.2f} "
                f"{e['kept_per_step']:>6.2f}"
            )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def run_offline_bench(
    base_config: EngineConfig,
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    baselines: Sequence[str],
    load: Callable[[], LoadedModel],
    say: Callable[[str], None] = print,
    detokenize: bool = True,
    structured: StructuredRun | None = None,
) -> dict[str, Any]:
    """Baselines first (on a model left on transformers' attention), then each policy.
    Raises OfflineBenchError before running anything if the trace does not fit the model."""
    from dataclasses import replace

    unknown = [name for name in baselines if name not in BASELINES]
    if unknown:
        raise OfflineBenchError(
            f"unknown baseline {', '.join(unknown)}; choose from {', '.join(BASELINES)}"
        )
    base_results = []
    if baselines:
        ref = load()
        check_token_ids(requests, ref)
        for name in baselines:
            say(f"running baseline {name} on {len(requests)} requests ...")
            base_results.append(run_baseline(name, ref, requests, base_config))
            say(f"  {name}: {base_results[-1].tokens_per_s:.1f} useful tokens/s")
        del ref
    loaded = load()
    check_token_ids(requests, loaded)
    ours = []
    compared = []
    for policy in policies:
        config = replace(base_config, batching=policy)
        for run in (None, structured) if structured else (None,):
            result = TraceRun(
                config, loaded, requests, detokenize=detokenize, structured=run
            ).run_to_end()
            ours.append(result)
            say(f"  {result.name}: {result.tokens_per_s:.1f} useful tokens/s")
        if structured:
            compared.append((ours[-2], ours[-1]))
    table = format_table(ours, base_results)
    if compared:
        table += "\n\n" + format_structured(compared, len(requests))
    return {
        "table": table,
        "warmup": WARMUP_NOTE,
        "phase_table": format_phase_table(ours),
        "draft_table": format_draft_table(ours),
        "results": [{**r.summary(), "extra": r.extra} for r in [*ours, *base_results]],
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=str))
