"""Decode attention read in place from the paged KV pool on the CPU: the C++ kernel.

The gathered path (engine/attention/paged_attention.py) copies each decode group's blocks into a
workspace, builds an additive mask and runs SDPA over it: per layer and step about ten torch ops,
and the step's keys and values cross memory three times. `jitney::paged_decode_`
(engine/kernels/csrc/layer_ops.cpp) reads each live key and value once, where it lies: one task
per (sequence, KV head) serves that head's whole GQA group, two passes over the positions its
block table names (scores and softmax, then the weighted sum of values), float32 throughout. It
serves a float32 model's pool of float32, bfloat16 or float16 K/V (widened as loaded), and only
where the C++ kernels built (engine/kernels/build.py).
"""

from __future__ import annotations

import torch

from engine.kernels.ops import kernel_backend

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unavailable_because(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    compute_dtype: torch.dtype | None = None,
) -> str | None:
    """Why the native kernel cannot serve this pool of `dtype` for a model computing in
    `compute_dtype` (None: the pool's) (None: it can)."""
    if device.type != "cpu":
        return f"the native kernel runs on the CPU, not {device.type}"
    if (compute_dtype or dtype) != torch.float32:
        return f"the native kernel serves float32 models, not {compute_dtype or dtype}"
    if dtype not in POOL_DTYPES:
        return f"the native kernel reads float32, bfloat16 or float16 pools, not {dtype}"
    if head_dim % 8:
        return f"the native kernel needs a head size that is a multiple of 8, not {head_dim}"
    backend = kernel_backend()
    if not backend.is_native:
        return f"the C++ kernels are not in use: {backend.reason}"
    return None


def native_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], one new token per sequence (rows may be strided)
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]: float32, bfloat16 or float16
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int64
    ctx_lens: torch.Tensor,  # [B] int64: keys at positions [0, ctx)
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D] to write into (may be a strided view)
) -> torch.Tensor:
    """Each sequence's query attends its own keys in place; returns `out` (or a new tensor)."""
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0]:
        torch.ops.jitney.paged_decode_(
            query, key_cache, value_cache, block_tables, ctx_lens, scale, window or 0, out
        )
    return out
