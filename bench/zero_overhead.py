"""The zero-overhead baseline of `jitney bench offline`: the trace's time if every step cost only
its model forward.

Schedule: the scheduler's own simulator runs the trace under continuous batching with the run's
`max_num_seqs`, every request at t=0, an unlimited token budget and KV pool. A request prefills
in the step that admits it (FIFO, as slots free up) and then decodes one token per step until it
has `output_len`, so step k decodes b_k sequences at a mean context of c_k tokens.

Cost: transformers' own decode step (one forward of [b, 1] new tokens over its contiguous
`DynamicCache` filled to the context, logits of the last position only) timed for every distinct
batch size b, or, past `max_points` of them, for `max_points` sizes spread over the range with
linear interpolation in between; each at the mean context of the steps with that batch size (the
cache holds zeros: the time does not depend on the values). Plus each prompt's prefill,
alone, timed once. Nothing else is paid: no scheduling, input packing, sampling or detokenizing.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from bench.baselines import RunResult
from bench.trace import TraceRequest
from engine.models.model_loader import LoadedModel
from engine.step_timing import sync_device
from scheduler import BatchingPolicy, SchedulerConfig, StepPlan
from scheduler import Sequence as SimSequence
from scheduler.simulator import SimRequest, simulate

ZERO_OVERHEAD = "zero-overhead"
DEFAULT_MAX_POINTS = 16
# Timed forwards per decode measurement, after one warm-up. The fastest counts: interference
# (another process on the cores) only ever adds time, and an ideal should not include it.
REPEATS = 3


@dataclass(slots=True)
class DecodeSchedule:
    """Per step k of the simulated run: who prefills, how many decode and at what mean context,
    who finishes at its end."""

    prefill_ids: list[list[str]] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    contexts: list[float] = field(default_factory=list)  # 0.0 where nothing decodes
    finished_ids: list[list[str]] = field(default_factory=list)

    def mean_context(self, batch_size: int) -> float:
        """Mean context of the decoding sequences over the steps that decode `batch_size`."""
        return statistics.fmean(
            c for b, c in zip(self.batch_sizes, self.contexts, strict=True) if b == batch_size
        )


def decode_schedule(requests: Sequence[TraceRequest], max_num_seqs: int) -> DecodeSchedule:
    sim = [SimRequest(r.request_id, 0, tuple(r.prompt_ids), r.output_len) for r in requests]
    # A budget no step can exhaust: every admitted prompt prefills whole in its first step.
    budget = sum(len(r.prompt_ids) for r in requests) + max_num_seqs
    schedule = DecodeSchedule()

    def observe(
        step: int, plan: StepPlan, released: list[SimSequence], policy: BatchingPolicy
    ) -> None:
        decode_starts = [c.start for c in plan.chunks if not c.is_prefill]
        schedule.prefill_ids.append([c.seq_id for c in plan.chunks if c.is_prefill])
        schedule.batch_sizes.append(len(decode_starts))
        schedule.contexts.append(statistics.fmean(decode_starts) if decode_starts else 0.0)
        schedule.finished_ids.append([seq.seq_id for seq in released])

    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    simulate(sim, "continuous", config, observer=observe)
    return schedule


def sampled_sizes(sizes: Sequence[int], max_points: int) -> list[int]:
    """All distinct sizes if there are at most `max_points`, else that many spread evenly over
    their sorted list (the smallest and largest always among them)."""
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    distinct = sorted(set(sizes))
    if len(distinct) <= max_points:
        return distinct
    last = len(distinct) - 1
    return sorted({distinct[round(i * last / (max_points - 1))] for i in range(max_points)})


def interpolate(points: dict[int, float], x: int) -> float:
    """Linear between the measured sizes around `x` (which lies within their range)."""
    xs = sorted(points)
    if x in points:
        return points[x]
    i = bisect.bisect(xs, x)
    if i == 0 or i == len(xs):
        raise ValueError(f"batch size {x} is outside the measured range {xs[0]}..{xs[-1]}")
    lo, hi = xs[i - 1], xs[i]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def _timed(
    loaded: LoadedModel,
    inputs: dict[str, torch.Tensor],
    repeats: int,
    make_cache: Callable[[], DynamicCache] | None = None,
    warmup: bool = True,
) -> float:
    """Fastest of `repeats` forwards (after one untimed warm-up), each on a fresh cache."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats + warmup):
            cache = make_cache() if make_cache is not None else None
            sync_device(loaded.model.device)
            start = time.perf_counter()
            loaded.model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
            sync_device(loaded.model.device)
            times.append(time.perf_counter() - start)
    return min(times[warmup:])


def time_decode_step(
    loaded: LoadedModel, batch_size: int, context: int, repeats: int = REPEATS
) -> float:
    """Seconds of one transformers decode step: `batch_size` rows, `context` cached tokens each."""
    model = loaded.model
    shape = (batch_size, loaded.num_kv_heads, context, loaded.head_dim)
    kv = [
        (
            torch.zeros(shape, dtype=model.dtype, device=model.device),
            torch.zeros(shape, dtype=model.dtype, device=model.device),
        )
        for _ in range(loaded.num_layers)
    ]

    def filled_cache() -> DynamicCache:
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)  # stores the tensors; the step's append copies them
        return cache

    inputs = {
        "input_ids": torch.zeros((batch_size, 1), dtype=torch.long, device=model.device),
        "position_ids": torch.full((batch_size, 1), context, device=model.device),
    }
    return _timed(loaded, inputs, repeats, filled_cache)


def time_prefill(loaded: LoadedModel, prompt_ids: list[int]) -> float:
    """Seconds of one prompt's prefill alone (batch 1, a fresh cache), measured once."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=loaded.model.device)
    return _timed(loaded, {"input_ids": ids}, 1, warmup=False)


def run_zero_overhead(
    loaded: LoadedModel,
    requests: Sequence[TraceRequest],
    max_num_seqs: int,
    max_points: int = DEFAULT_MAX_POINTS,
) -> RunResult:
    """The ideal run's timeline from measured forwards; `loaded` on transformers' attention."""
    measuring_start = time.perf_counter()
    schedule = decode_schedule(requests, max_num_seqs)
    decoding = [b for b in schedule.batch_sizes if b]
    points = {
        b: time_decode_step(loaded, b, round(schedule.mean_context(b)))
        for b in (sampled_sizes(decoding, max_points) if decoding else [])
    }
    if requests:  # a warm-up: the decode points did not run a prompt's shapes
        time_prefill(loaded, requests[0].prompt_ids)
    prefill = {r.request_id: time_prefill(loaded, r.prompt_ids) for r in requests}

    clock = decode_s = 0.0
    ttft: dict[str, float] = {}
    done: dict[str, float] = {}
    for prefill_ids, b, finished_ids in zip(
        schedule.prefill_ids, schedule.batch_sizes, schedule.finished_ids, strict=True
    ):
        step_decode = interpolate(points, b) if b else 0.0
        decode_s += step_decode
        clock += step_decode + sum(prefill[rid] for rid in prefill_ids)
        for rid in prefill_ids:  # a prefill samples the request's first token
            ttft.setdefault(rid, clock)
        for rid in finished_ids:
            done[rid] = clock
    return RunResult(
        name=ZERO_OVERHEAD,
        wall_s=clock,
        num_output_tokens=sum(r.output_len for r in requests),
        latencies_s=done,
        ttft_s=ttft,
        extra={
            "modelled": "forward times only, summed over the simulated continuous schedule",
            "max_num_seqs": max_num_seqs,
            "steps": len(schedule.batch_sizes),
            "decode_s": round(decode_s, 3),
            "prefill_s": round(sum(prefill.values()), 3),
            "distinct_batch_sizes": len(set(decoding)),
            # batch size -> [mean context, ms per decode step]; the rest interpolated
            "measured": {
                b: [round(schedule.mean_context(b), 1), round(1000 * t, 3)]
                for b, t in points.items()
            },
            "measuring_s": round(time.perf_counter() - measuring_start, 1),
        },
    )
