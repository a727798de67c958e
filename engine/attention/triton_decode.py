"""Decode attention read in place from the paged KV pool: one Triton kernel, no gathered copy.

The portable decode path (engine/attention/paged_attention.py) copies each sequence's blocks into
a workspace, then runs SDPA over it: the step's keys and values cross memory three times (read,
write, read again), and a padded CUDA-graph step also reads the padding up to its width bucket.
On a GPU the decode step is bound by memory traffic, so for the Llama 3.1 8B at batch 64 with
512-token contexts that copy is about as large as the weights themselves (4 GiB of K/V read
three times, against 16 GB of weights). This kernel reads each live key and value once:
- one program per (sequence, KV head) serves that KV head's whole query group (GQA), so K/V are
  loaded once for all the heads that share them; the group is padded to 16 rows for `tl.dot`;
- it walks the sequence's context in tiles of `TILE` token positions, finding each position's
  block through the block table (positions past the context, or before a sliding window, are
  masked: a padded table costs nothing), with an online softmax (running max and sum) in fp32.
Triton is imported lazily: it is present beside CUDA builds of torch (the lent H200 has 3.6).
`resolve_decode_attention` decides (EngineConfig.decode_attention, `--decode-attention`), after a
self-check that compiles the kernel for the model's shape and compares it with gathered SDPA.
The tests run it on the CPU under Triton's interpreter (TRITON_INTERPRET=1, fp32 and fp16: the
interpreter mishandles bf16).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import native_decode

TILE = 64  # token positions per loop iteration
MIN_DOT_ROWS = 16  # tl.dot's smallest M


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr,  # [B, Hq, D]
        k_ptr,  # [num_blocks, block_size, Hkv, D]
        v_ptr,
        out_ptr,  # [B, Hq, D]
        table_ptr,  # [B, W] block ids
        ctx_ptr,  # [B] context lengths
        scale,
        window,  # keys in [ctx - window, ctx); 0: no window
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_ob,
        stride_oh,
        stride_tb,
        GROUPS: tl.constexpr,
        GROUPS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx = tl.load(ctx_ptr + seq).to(tl.int32)
        rows = tl.arange(0, GROUPS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUPS + rows
        live_rows = rows < GROUPS
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=live_rows[:, None],
            other=0.0,
        )
        # No branch on `window` (a runtime value): both sides of an `if` must agree in type.
        start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
        m_i = tl.full([GROUPS_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUPS_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUPS_PAD, HEAD_DIM], dtype=tl.float32)
        for first in range((start // TILE_N) * TILE_N, ctx, TILE_N):
            pos = first + tl.arange(0, TILE_N)
            live = (pos < ctx) & (pos >= start)
            block = tl.load(table_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=live, other=0)
            block = block.to(tl.int64)
            offset = pos % BLOCK_SIZE
            k = tl.load(
                k_ptr
                + (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None]
                + dims[None, :],
                mask=live[:, None],
                other=0.0,
            )
            if IEEE:  # fp32: exact products, as SDPA on the other path (not tf32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr
                + (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None]
                + dims[None, :],
                mask=live[:, None],
                other=0.0,
            )
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=live_rows[:, None],
        )

    return paged_decode


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """What the kernel is compiled for (with the device): a model's attention and its pool."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the pool's
    compute_dtype: torch.dtype | None = None  # the model's (None: the pool's)


def unavailable_because(device: torch.device, shape: DecodeShape) -> str | None:
    """Why the kernel cannot serve `shape` on `device`, or None when it can: it needs Triton
    with a CUDA device (or Triton's CPU interpreter), K/V stored in the model's dtype, whole query
    groups, and a power-of-two head size of at least 16."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "on the CPU Triton runs only as its interpreter (TRITON_INTERPRET=1, for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton backend for {device.type}"
    if shape.compute_dtype not in (None, shape.dtype):
        return f"the Triton kernel reads a pool of the model's dtype, not {shape.dtype}"
    d = shape.head_dim
    if shape.num_heads % shape.num_kv_heads or d < 16 or d & (d - 1):
        return (
            f"{shape.num_heads} heads over {shape.num_kv_heads} KV heads of size {d} do not fit it"
        )
    return None


@functools.cache
def self_check(device: torch.device, shape: DecodeShape) -> str | None:
    """Compile the kernel for `shape` and compare it with gathered SDPA on a small problem
    (contexts of 1, a block and one more, several tiles): None, or what went wrong. A Triton
    that fails to build it here (a version, a driver) must not take the engine down."""
    gen = torch.Generator().manual_seed(0)
    bs, blocks = shape.block_size, 12
    ctx = [1, bs + 1, min(blocks * bs, 3 * TILE + 5)]
    pool = (blocks, bs, shape.num_kv_heads, shape.head_dim)
    k, v = (torch.randn(pool, generator=gen) for _ in range(2))
    q = torch.randn(len(ctx), shape.num_heads, shape.head_dim, generator=gen)
    tables = torch.stack([torch.randperm(blocks, generator=gen) for _ in ctx])
    scale = shape.head_dim**-0.5
    want = torch.empty_like(q)
    groups = shape.num_heads // shape.num_kv_heads
    for b, n in enumerate(ctx):  # the portable path's arithmetic, in float32
        keys = k[tables[b]].flatten(0, 1)[:n].repeat_interleave(groups, 1).transpose(0, 1)
        values = v[tables[b]].flatten(0, 1)[:n].repeat_interleave(groups, 1).transpose(0, 1)
        weights = torch.softmax(q[b][:, None] @ keys.transpose(1, 2) * scale, -1)
        want[b] = (weights @ values)[:, 0]
    try:
        got = paged_decode_attention(
            *(t.to(device, shape.dtype) for t in (q, k, v)),
            tables.to(device),
            torch.tensor(ctx, device=device),
            scale,
        )
        error = (got.float().cpu() - want).abs().max().item()
    except Exception as e:  # any failure to build or run it: reported, then not used
        return f"the kernel failed its self-check: {type(e).__name__}: {e}"
    tolerance = 1e-4 if shape.dtype == torch.float32 else 5e-2
    if not error <= tolerance:
        return f"the kernel failed its self-check: max error {error:.3g} > {tolerance}"
    return None


def resolve_decode_attention(
    choice: str, device: torch.device, shape: DecodeShape
) -> tuple[str | None, str | None]:
    """EngineConfig.decode_attention resolved: (the in-place kernel or None for gather, why
    none). "auto" takes Triton on CUDA when it runs and passes its self-check, the native C++
    kernel on a CPU where it serves the pool (engine/attention/native_decode.py); "triton" and
    "native" refuse to start without theirs; "gather" never uses one."""
    if choice == "gather":
        return None, None
    if choice == "native" or (choice == "auto" and device.type == "cpu"):
        why = native_decode.unavailable_because(
            device, shape.dtype, shape.head_dim, shape.compute_dtype
        )
        if choice == "native" and why is not None:
            raise ValueError(f"--decode-attention native: {why}")
        return (None, why) if why is not None else ("native", None)
    if choice == "auto" and device.type != "cuda":  # (without importing Triton: a worker's start)
        return None, "auto takes an in-place kernel on CUDA and on the CPU only"
    why = unavailable_because(device, shape) or self_check(device, shape)
    if choice == "triton" and why is not None:
        raise ValueError(f"--decode-attention triton: {why}")
    return (None, why) if why is not None else ("triton", None)


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], one new token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W]: block j holds positions [j * bs, (j + 1) * bs)
    ctx_lens: torch.Tensor,  # [B]: keys at positions [0, ctx)
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D] to write into (may be a strided view)
) -> torch.Tensor:
    """Each sequence's query attends its own keys in place; returns `out` (or a new tensor)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    groups = num_heads // num_kv_heads
    query = query.to(key_cache.dtype)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    _kernel()[(batch, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        ctx_lens,
        scale,
        window or 0,
        query.stride(0),
        query.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUPS=groups,
        GROUPS_PAD=max(MIN_DOT_ROWS, 1 << (groups - 1).bit_length()),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=TILE,
        IEEE=key_cache.dtype == torch.float32,
    )
    return out
