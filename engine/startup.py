"""What the engine decides once, at start: decode attention, memory, KV pool, runner, graphs.

In order (each step needs the ones before it):
1. the decode attention: the Triton kernel where it runs (`--decode-attention`), else gather;
2. on CUDA without a fixed `--kv-cache-memory`: the largest step's peak memory, measured on a
   dummy step (engine/memory_profile.py), plus what decode graphs keep beside the pool;
3. the KV budget and the capacity it yields (engine/capacity.py: refuses to start when not even
   one max-length request fits);
4. the paged KV pool, one block larger than the scheduler's (the scratch block padded decode
   rows write to), and the model runner on it, with decode graphs captured (CUDA, not eager).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.triton_decode import DecodeShape, resolve_decode_attention
from engine.capacity import KVCapacity, budget_bytes, draft_budget_bytes, plan_capacity
from engine.config import EngineConfig
from engine.heap import return_freed_heap
from engine.kernels import kernel_backend
from engine.kernels.build import DRAFT_ROW_COST, INTEGER_ISAS, ONE_PASS_TOKENS
from engine.kv_cache import KVCacheSpec, PagedKVCache, kv_storage_dtype
from engine.memory_profile import step_peak_bytes
from engine.models.forward import ModelForward
from engine.models.loaded_model import LoadedModel
from engine.runner.decode_graphs import CudaGraphCapture, graph_reserved_bytes
from engine.runner.model_runner import QUANTIZED_FORWARDS, ModelRunner, resolve_forward
from engine.speculative_options import SPEC

logger = logging.getLogger("jitney.engine")


@dataclass(frozen=True, slots=True)
class StartupPlan:
    """What start-up decided, kept by the engine for its life."""

    capacity: KVCapacity
    kv_cache: PagedKVCache
    runner: ModelRunner
    # Which forward runs the model and how it keeps its weights ("jitney-gguf", "transformers",
    # ...; engine/runner/model_runner.py resolve_forward), with `auto` settings resolved.
    forward_name: str
    # Why decode tokens do not attend through the Triton kernel (None: they do, or the device
    # has none to offer); bench/gpu_check.py reports it.
    decode_kernel_unused_because: str | None
    # Speculation's row cap (`speculative_step_rows`) and a draft row's cost (`draft_row_cost`).
    speculative_max_step_tokens: int = SPEC.max_step_tokens
    speculative_draft_row_cost: float = SPEC.draft_row_cost
    # The draft model's KV pool, out of the same budget (engine/draft_model.py; 0: none).
    draft_kv_bytes: int = 0


def plan_engine(config: EngineConfig, loaded: LoadedModel) -> StartupPlan:
    device = config.torch_device
    if device.type == "cpu":  # the sampler's and the quantized layers' C++ (built once, cached)
        backend = kernel_backend()
        logger.info("CPU kernels: %s %s (%s)", backend.name, backend.isa or "", backend.reason)
        backend.set_activation_digits(config.activation_digits)
        if backend.isa in INTEGER_ISAS:
            logger.info("CPU kernels: %d int8 digit(s) an activation", config.activation_digits)
    forward_name, forward = resolve_forward(
        loaded, config.model_impl, config.quantization, config.compile, config.max_model_len
    )
    logger.info("forward: %s", forward_name)
    return_freed_heap()  # packing the weights' blocks went through temporaries (engine/heap.py)
    spec = kv_cache_spec(config, loaded, forward_name)
    logger.info(
        "KV cache: %s (attention in %s)",
        *(str(d).removeprefix("torch.") for d in (spec.dtype, spec.attention_dtype)),
    )
    use_graphs = device.type == "cuda" and not config.enforce_eager
    decode_kernel, why_not = decode_attention_for(config, device, loaded.config, spec)
    step_peak = None
    if device.type == "cuda" and config.kv_cache_memory is None:
        step_peak = _step_peak(config, loaded, forward, spec, decode_kernel, use_graphs)
    budget = budget_bytes(config, device, step_peak)
    draft_kv_bytes = draft_budget_bytes(config, budget)
    capacity = plan_capacity(config, spec, loaded.max_model_len, budget - draft_kv_bytes)
    kv_cache = PagedKVCache(spec, capacity.num_blocks + 1, device, decode_kernel)
    runner = ModelRunner(forward, kv_cache)
    if use_graphs:
        runner.enable_decode_graphs(config.max_num_seqs, capacity.max_model_len, CudaGraphCapture())
    rows = speculative_step_rows(config, forward_name)
    return StartupPlan(
        capacity,
        kv_cache,
        runner,
        forward_name,
        why_not,
        rows,
        draft_row_cost(config, forward_name),
        draft_kv_bytes,
    )


def speculative_step_rows(config: EngineConfig, forward_name: str) -> int:
    """`speculative.max_step_tokens`, with None resolved: where the forward runs the CPU's
    quantized kernels, the tokens one pass of them serves at the level in use (a row more
    starts a second pass: on a Zen 3 at avx2-int16 the linears of 6 rows cost 1.8x one row's
    and of 8 rows 2.7x; docs/notes/speculation.md), else SPEC.max_step_tokens."""
    if config.speculative.max_step_tokens is not None:
        return config.speculative.max_step_tokens
    if (isa := _one_pass_isa(forward_name)) is not None:
        rows = ONE_PASS_TOKENS[isa]
        logger.info("speculation: up to %d rows a step (one pass at %s)", rows, isa)
        return rows
    return SPEC.max_step_tokens


def draft_row_cost(config: EngineConfig, forward_name: str) -> float:
    """`speculative.draft_row_cost`, with None resolved: the measured share of a step one more
    row costs at the CPU kernels' level in use where the forward is quantized, else
    SPEC.draft_row_cost."""
    if config.speculative.draft_row_cost is not None:
        return config.speculative.draft_row_cost
    isa = _one_pass_isa(forward_name)
    return SPEC.draft_row_cost if isa is None else DRAFT_ROW_COST[isa]


def _one_pass_isa(forward_name: str) -> str | None:
    """The CPU kernels' level where `forward_name` runs them natively (else None)."""
    if forward_name not in QUANTIZED_FORWARDS:
        return None
    backend = kernel_backend()
    return backend.isa if backend.is_native else None


def kv_cache_spec(config: EngineConfig, loaded: LoadedModel, forward_name: str) -> KVCacheSpec:
    """The pool's shape for `loaded` run by `forward_name`: K/V in `--kv-cache-dtype` (auto:
    engine/kv_cache.py kv_storage_dtype)."""
    dtype = loaded.dtype
    return KVCacheSpec(
        loaded.num_layers,
        loaded.num_kv_heads,
        loaded.head_dim,
        kv_storage_dtype(config.kv_cache_dtype, dtype, forward_name in QUANTIZED_FORWARDS),
        config.block_size,
        compute_dtype=dtype,
    )


def decode_attention_for(
    config: EngineConfig, device: torch.device, model_config: Any, spec: KVCacheSpec
) -> tuple[str | None, str | None]:
    """The in-place kernel decode tokens attend through (None: gathered), and if none, why.
    `model_config`: the model's (LoadedModel.config)."""
    shape = DecodeShape(
        getattr(model_config, "num_attention_heads", spec.num_kv_heads),
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        spec.dtype,
        spec.attention_dtype,
    )
    decode_kernel, why_not = resolve_decode_attention(config.decode_attention, device, shape)
    if why_not is not None and device.type == "cuda":
        logger.warning("decode attention: gather (%s)", why_not)
    return decode_kernel, why_not


def _step_peak(
    config: EngineConfig,
    loaded: LoadedModel,
    forward: ModelForward,
    spec: KVCacheSpec,
    decode_kernel: str | None,
    use_graphs: bool,
) -> int | None:
    """What the largest step needs beside the cache, measured, and what decode graphs keep:
    their shared logits buffer and, unless the kernel reads K/V in place, the read workspace
    (at most the longest context's)."""
    step_peak = step_peak_bytes(
        forward,
        loaded.device,
        spec,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        decode_kernel,
    )
    if step_peak is not None and use_graphs:
        longest = config.max_model_len or loaded.max_model_len
        step_peak += graph_reserved_bytes(
            spec, config.max_num_seqs, longest, loaded.vocab_size, decode_kernel
        )
    return step_peak
