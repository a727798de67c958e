"""The two baselines of `jitney bench offline`, run on the same requests as our engine.

- hf-generate: transformers `generate` over static, left-padded batches in trace order; every
  batch runs to its longest request, so padding and overrun steps are paid for but not counted.
- hf-cb: transformers' own continuous batching (`init_continuous_batching`), one request each
  with its own `max_new_tokens` and EOS disabled.

Offline means every request arrives at t=0: a latency is the time from the start of the run to
the request's completion. Both runners generate exactly `output_len` tokens per request, greedily.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    ContinuousBatchingConfig,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from bench.trace import TraceRequest, percentile
from engine.models.model_loader import LoadedModel
from engine.step_timing import sync_device

HF_GENERATE = "hf-generate"
HF_CB = "hf-cb"
_CB_PAGE_KEY = (
    "page_size"
    if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    else "block_size"
)
NO_EOS = -1  # transformers' own "no end-of-sequence token" for both generate and CB

# Settings `best_hf_cb` tries when given none; each is a set of ContinuousBatchingConfig fields.
# On 2 CPU cores (SmolLM2, 16 mixed requests) transformers' defaults were fastest: 8192-token
# batches prefill every prompt in one forward; 256/512-token batches were ~12 % slower.
DEFAULT_CB_CANDIDATES: list[dict[str, Any]] = [
    {},  # transformers' defaults: 8192 batch tokens, 256-token pages (num_blocks sized below)
    {"max_batch_tokens": 256, "max_requests_per_batch": 16},
    {"max_batch_tokens": 512, "max_requests_per_batch": 16, "page_size": 32},
]


@dataclass(slots=True)
class RunResult:
    name: str
    wall_s: float
    num_output_tokens: int  # useful tokens: sum of min(generated, output_len) over requests
    latencies_s: dict[str, float]  # request id -> completion time since the start of the run
    ttft_s: dict[str, float] = field(default_factory=dict)  # request id -> first token time
    outputs: dict[str, list[int]] = field(default_factory=dict)  # generated ids, trimmed
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_latency_s(self) -> float:
        return _mean(self.latencies_s.values())

    @property
    def p50_latency_s(self) -> float:
        return percentile(list(self.latencies_s.values()), 50)

    @property
    def p99_latency_s(self) -> float:
        return percentile(list(self.latencies_s.values()), 99)

    @property
    def mean_ttft_s(self) -> float:
        return _mean(self.ttft_s.values())

    def summary(self) -> dict[str, Any]:
        """The headline numbers, JSON-ready."""
        return {
            "name": self.name,
            "wall_s": round(self.wall_s, 3),
            "output_tokens": self.num_output_tokens,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "mean_latency_s": round(self.mean_latency_s, 3),
            "p50_latency_s": round(self.p50_latency_s, 3),
            "p99_latency_s": round(self.p99_latency_s, 3),
            "mean_ttft_s": round(self.mean_ttft_s, 3),
        }


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _pad_id(loaded: LoadedModel) -> int:
    pad = loaded.tokenizer.pad_token_id
    return pad if pad is not None else loaded.eos_token_ids[0]


class _DropNegativeEosWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("`eos_token_id` should consist of positive")


@contextmanager
def _quiet_negative_eos_warning() -> Iterator[None]:
    # generate warns on every call that eos -1 "will not stop until the maximum length": intended.
    log = logging.getLogger("transformers.generation.utils")
    quiet = _DropNegativeEosWarning()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


class _FirstStepClock(StoppingCriteria):
    """Never stops anything; stamps the time the first generated token of a batch exists."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.time: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.time is None:
            sync_device(self.device)  # generate runs ahead of its kernels on CUDA
            self.time = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate_static_batch(
    loaded: LoadedModel, batch: Sequence[TraceRequest]
) -> tuple[list[list[int]], float, float]:
    """One left-padded greedy `generate` call; returns (trimmed outputs, first-token time, end)."""
    model = loaded.model
    device = model.device
    pad = _pad_id(loaded)
    width = max(len(r.prompt_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        attention_mask[row, width - len(r.prompt_ids) :] = 1
    steps = max(r.output_len for r in batch)
    # eos_token_id=-1 disables EOS (None would fall back to the model's), exactly as hf-cb does;
    # min_new_tokens would also run to the end but masks EOS, which changes the greedy tokens.
    config = GenerationConfig(
        do_sample=False, max_new_tokens=steps, pad_token_id=pad, eos_token_id=NO_EOS
    )
    clock = _FirstStepClock(device)
    with torch.inference_mode(), _quiet_negative_eos_warning():
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    sync_device(device)
    end = time.perf_counter()
    new_tokens = out[:, width:].tolist()
    outputs = [row[: r.output_len] for row, r in zip(new_tokens, batch, strict=True)]
    return outputs, clock.time if clock.time is not None else end, end


def run_hf_generate(
    loaded: LoadedModel, requests: Sequence[TraceRequest], batch_size: int = 16, warmup: bool = True
) -> RunResult:
    """Static batching: batches of `batch_size` in trace order, each to its longest output_len."""
    if warmup and requests:  # first calls pay one-off allocation/dispatch costs; keep them out
        _generate_static_batch(loaded, [TraceRequest("warmup", requests[0].prompt_ids, 2)])
    latencies: dict[str, float] = {}
    ttft: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    token_slots = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        batch_outputs, first, end = _generate_static_batch(loaded, batch)
        token_slots += len(batch) * max(r.output_len for r in batch)
        for r, tokens in zip(batch, batch_outputs, strict=True):
            outputs[r.request_id] = tokens
            ttft[r.request_id] = first - start
            latencies[r.request_id] = end - start  # a request is returned with its whole batch
    wall = time.perf_counter() - start
    useful = sum(len(t) for t in outputs.values())
    return RunResult(
        name=HF_GENERATE,
        wall_s=wall,
        num_output_tokens=useful,
        latencies_s=latencies,
        ttft_s=ttft,
        outputs=outputs,
        extra={
            "batch_size": batch_size,
            "num_batches": -(-len(requests) // batch_size),
            "generated_token_slots": token_slots,  # rows x steps, padding and overrun included
            "slot_efficiency": useful / token_slots if token_slots else 0.0,
            "latency_note": "a request completes when its batch does",
        },
    )


def run_hf_cb(loaded: LoadedModel, requests: Sequence[TraceRequest], **settings: Any) -> RunResult:
    """transformers continuous batching; `settings` are ContinuousBatchingConfig fields.

    The ones that matter: `max_batch_tokens` (tokens per forward, prefill chunks included),
    `max_requests_per_batch`, `num_blocks` and `page_size` (`block_size` is accepted as its old
    name). `num_blocks` defaults to room for every request at once: left unset, transformers sizes
    the KV cache (and an attention mask over all of it) from 60 % of free RAM on CPU.
    """
    settings = dict(settings)
    # The page size is `page_size` in newer transformers, `block_size` in 5.17 and before.
    page_key = _CB_PAGE_KEY
    for name in ("page_size", "block_size"):
        if name in settings:
            settings[page_key] = settings.pop(name)
    cb_config = ContinuousBatchingConfig(**settings)
    if cb_config.num_blocks is None:
        cb_config.num_blocks = sum(
            -(-(len(r.prompt_ids) + r.output_len) // getattr(cb_config, page_key)) for r in requests
        )
    # Each request gets its own length and NO_EOS (add_request's None means "the config's EOS").
    gen_config = GenerationConfig(
        do_sample=False,
        eos_token_id=NO_EOS,
        pad_token_id=_pad_id(loaded),
        max_new_tokens=max((r.output_len for r in requests), default=1),
    )
    model = loaded.model
    wanted = {r.request_id: r.output_len for r in requests}
    results = {}
    # no_grad, not inference_mode: transformers 5.17's generation thread (outside inference
    # mode, which is per thread) resets the cache tensors warmup made here, and in-place writes
    # to inference tensors are refused there, failing every request.
    with torch.no_grad():
        manager = model.init_continuous_batching(
            generation_config=gen_config, continuous_batching_config=cb_config
        )
        try:
            manager.warmup()  # builds the paged cache now, outside the timed region
            start = time.perf_counter()
            manager.start()
            for r in requests:
                manager.add_request(
                    r.prompt_ids,
                    request_id=r.request_id,
                    max_new_tokens=r.output_len,
                    record_timestamps=True,  # per-token stamps give the TTFT
                    eos_token_id=NO_EOS,
                )
            while len(results) < len(requests):
                result = manager.get_result(timeout=1.0)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break  # the generation thread died; report what finished
            wall = time.perf_counter() - start
            resolved = manager.continuous_batching_config
        finally:
            manager.stop(block=True, timeout=30)  # also restores the model's attention backend
            manager.destroy()

    failed = {rid: res.error for rid, res in results.items() if res.error}
    failed.update((r.request_id, "no result") for r in requests if r.request_id not in results)
    if failed:  # a run with failed requests measures nothing: say why, not "0 tokens/s"
        rid, error = next(iter(failed.items()))
        raise RuntimeError(
            f"{len(failed)} of {len(requests)} requests failed in transformers' continuous "
            f"batching (request {rid}: {error})"
        )
    outputs = {rid: list(res.generated_tokens[: wanted[rid]]) for rid, res in results.items()}
    mismatched = {
        rid: len(res.generated_tokens)
        for rid, res in results.items()
        if len(res.generated_tokens) != wanted[rid]
    }
    return RunResult(
        name=HF_CB,
        wall_s=wall,
        num_output_tokens=sum(len(t) for t in outputs.values()),
        # lifespan[1] is stamped (perf_counter) when the request finishes, before delivery.
        latencies_s={rid: res.lifespan[1] - start for rid, res in results.items()},
        ttft_s={rid: res.timestamps[0] - start for rid, res in results.items() if res.timestamps},
        outputs=outputs,
        extra={
            "settings": settings,
            "resolved": {
                key: getattr(resolved, key)
                for key in ("max_batch_tokens", "max_requests_per_batch", "num_blocks", page_key)
            },
            "length_mismatch": mismatched,  # request id -> tokens generated, when != output_len
        },
    )


def best_hf_cb(
    loaded: LoadedModel,
    requests: Sequence[TraceRequest],
    candidates: Sequence[dict[str, Any]] | None = None,
) -> RunResult:
    """Run hf-cb once per settings and return the fastest, with every attempt in extra['tried'].
    Settings a transformers version refuses (its memory planner, say) are recorded and skipped;
    if every one fails, the last error is raised."""
    tried: list[dict[str, Any]] = []
    best: RunResult | None = None
    error: Exception | None = None
    for settings in DEFAULT_CB_CANDIDATES if candidates is None else candidates:
        try:
            result = run_hf_cb(loaded, requests, **settings)
        except (RuntimeError, ValueError, MemoryError) as e:
            tried.append({"settings": dict(settings), "error": f"{type(e).__name__}: {e}"})
            error = e
            continue
        tps, wall = result.tokens_per_s, result.wall_s
        tried.append({"settings": dict(settings), "tokens_per_s": tps, "wall_s": wall})
        if best is None or result.tokens_per_s > best.tokens_per_s:
            best = result
    if best is None:
        raise error or ValueError("best_hf_cb needs at least one candidate")
    best.extra["tried"] = tried
    return best
