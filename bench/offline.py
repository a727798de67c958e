"""`jitney bench offline`: our engine vs transformers' baselines on one trace, in one run.

Every request arrives at t=0 and generates exactly its `output_len` tokens (EOS ignored), so every
system does the same useful work; the table reports each policy's ratio to each baseline measured
in the same process, on the same machine, moments apart.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.baselines import HF_CB, HF_GENERATE, RunResult, best_hf_cb, run_hf_generate
from bench.trace import TraceRequest
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.model_loader import LoadedModel
from engine.sampling import SamplingParams

BASELINES = (HF_GENERATE, HF_CB)


@dataclass(slots=True)
class _Clock:
    """Per-request first-token and completion times, relative to the run's start."""

    start: float
    ttft: dict[str, float]
    done: dict[str, float]

    def saw(self, request_id: str, finished: bool, has_tokens: bool) -> None:
        now = time.perf_counter() - self.start
        if has_tokens:
            self.ttft.setdefault(request_id, now)
        if finished:
            self.done[request_id] = now


def run_jitney(
    config: EngineConfig,
    loaded: LoadedModel,
    requests: Sequence[TraceRequest],
    warmup: bool = True,
) -> RunResult:
    """Run the trace through the engine with `config.batching`; all requests at t=0."""
    engine = Engine(config, loaded=loaded)
    if warmup and requests:
        engine.generate([requests[0].prompt_ids], SamplingParams(max_tokens=2, temperature=0))
    clock = _Clock(time.perf_counter(), {}, {})
    outputs: dict[str, list[int]] = {}
    for r in requests:
        params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
        engine.add_request(r.request_id, r.prompt_ids, params, arrival_time=time.monotonic())
        outputs[r.request_id] = []
    engine.flush()
    steps = peak_blocks = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            clock.saw(out.request_id, out.finished, bool(out.new_token_ids))
        steps += 1
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
    wall = time.perf_counter() - clock.start
    useful = sum(len(v) for v in outputs.values())
    return RunResult(
        name=f"jitney-{config.batching}",
        wall_s=wall,
        num_output_tokens=useful,
        latencies_s=clock.done,
        ttft_s=clock.ttft,
        outputs=outputs,
        extra={
            "steps": steps,
            "slot_util": useful / (steps * config.max_num_seqs) if steps else 0.0,
            "preemptions": engine.policy.stats.num_preemptions_total,
            "peak_kv_blocks": peak_blocks,
            "kv_blocks_total": engine.block_manager.num_blocks,
        },
    )


def run_baseline(name: str, loaded: LoadedModel, requests: Sequence[TraceRequest]) -> RunResult:
    if name == HF_GENERATE:
        return run_hf_generate(loaded, requests, batch_size=16)
    if name == HF_CB:
        return best_hf_cb(loaded, requests)
    raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")


def format_table(ours: list[RunResult], baselines: list[RunResult]) -> str:
    header = (
        f"{'system':<20} {'tok/s':>8} {'mean lat':>9} {'p50 lat':>8} {'p99 lat':>8} "
        f"{'mean TTFT':>9} {'slot util':>9} {'preempt':>7} {'peak KV':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in [*ours, *baselines]:
        util = r.extra.get("slot_util", r.extra.get("slot_efficiency"))
        lines.append(
            f"{r.name:<20} {r.tokens_per_s:>8.1f} {r.mean_latency_s:>8.1f}s "
            f"{r.p50_latency_s:>7.1f}s {r.p99_latency_s:>7.1f}s {r.mean_ttft_s:>8.2f}s "
            f"{_pct(util):>9} {r.extra.get('preemptions', '-')!s:>7} "
            f"{r.extra.get('peak_kv_blocks', '-')!s:>8}"
        )
    if baselines:
        lines.append("")
        for r in ours:
            ratios = ", ".join(
                f"{r.tokens_per_s / b.tokens_per_s:.2f}x {b.name}" for b in baselines
            )
            lines.append(f"{r.name}: useful tokens/s = {ratios}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def run_offline_bench(
    base_config: EngineConfig,
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    baselines: Sequence[str],
    load: Callable[[], LoadedModel],
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Baselines first (on a model left on transformers' attention), then each policy."""
    from dataclasses import replace

    base_results = []
    if baselines:
        ref = load()
        for name in baselines:
            say(f"running baseline {name} on {len(requests)} requests ...")
            base_results.append(run_baseline(name, ref, requests))
            say(f"  {name}: {base_results[-1].tokens_per_s:.1f} useful tokens/s")
        del ref
    loaded = load()
    ours = []
    for policy in policies:
        say(f"running jitney --batching {policy} ...")
        ours.append(run_jitney(replace(base_config, batching=policy), loaded, requests))
        say(f"  jitney-{policy}: {ours[-1].tokens_per_s:.1f} useful tokens/s")
    return {
        "table": format_table(ours, base_results),
        "results": [{**r.summary(), "extra": r.extra} for r in [*ours, *base_results]],
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=str))
