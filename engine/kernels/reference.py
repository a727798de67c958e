"""The jitney:: ops in pure torch: the quantized linears dequantize to float32, then F.linear /
indexing; the layer ops are the few torch ops each stands for.

The fallback where the C++ kernels cannot be built, and the definition of what they compute. The
packed layout is engine/kernels/csrc/quant_linear.cpp's (qs per row, d and m float32 [N, K/32]).
Dequantizing is bit-exact with gguf's `dequantize`: d*q is exact in float32 and `+ m` rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block, along the input dimension


def q4_1_dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 nibbles + d, m [N, K/32] -> float32 [N, K]."""
    n, nb = d.shape
    nibbles = qs.view(n, nb, BLOCK // 2)
    # ggml's order: byte j of a block holds element j (low nibble) and element j + 16 (high).
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.float32)
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).view(n, nb * BLOCK)


def q8_0_dequantize(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 + d [N, K/32] -> float32 [N, K]."""
    n, nb = d.shape
    return (qs.view(n, nb, BLOCK).to(torch.float32) * d.unsqueeze(-1)).view(n, nb * BLOCK)


def q4_1_linear(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, panel_min_tokens: int
) -> torch.Tensor:
    return F.linear(x, q4_1_dequantize(qs, d, m))


def q8_0_linear(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, panel_min_tokens: int
) -> torch.Tensor:
    return F.linear(x, q8_0_dequantize(qs, d))


def q8_0_embedding(ids: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).long()
    return q8_0_dequantize(qs[flat], d[flat]).view(*ids.shape, qs.shape[1])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of x [T, K] over their root mean square, times w [K] (float32 throughout)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm_(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x += r (the residual stream, in place), then rms_norm(x)."""
    x.add_(r)
    return rms_norm(x, w, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2F] -> silu(gate) * up, gate and up its two halves."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_write_kv_(
    qkv: torch.Tensor,  # [T, (H + 2 KV) * D]
    cos: torch.Tensor,  # [T, D], both halves
    sin: torch.Tensor,
    slots: torch.Tensor,  # [T] int64: each token's cache slot
    key_slots: torch.Tensor,  # [slots, KV, D], written
    value_slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None,  # [D] (Qwen3's per-head norms) or None
    k_norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """[T, H + KV, D]: Q's and K's heads, each normed (where a weight is given) and rotated by
    its token's angles; K and V written to their slots."""
    num_tokens = qkv.shape[0]
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, -1)
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    half = heads.shape[-1] // 2
    qk = torch.cat([q, k], dim=1)
    c, s = cos[:, None], sin[:, None]
    qk = qk * c + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * s
    key_slots[slots] = qk[:, num_heads:]
    value_slots[slots] = v
    return qk


def paged_decode_(
    q: torch.Tensor,  # [B, H, D]: one token per sequence
    key_cache: torch.Tensor,  # [blocks, block_size, KV, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int64
    ctx_lens: torch.Tensor,  # [B]: keys at positions [0, ctx)
    scale: float,
    window: int,  # > 0: only the last `window` keys
    out: torch.Tensor,  # [B, H, D], written
) -> None:
    """Each sequence's query over its own keys, gathered from its blocks."""
    num_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(ctx_lens[b])
        lo = max(0, n - window) if window > 0 else 0
        keys = key_cache[block_tables[b]].flatten(0, 1)[lo:n]  # [n, KV, D]
        values = value_cache[block_tables[b]].flatten(0, 1)[lo:n]
        groups = num_heads // num_kv_heads
        keys = keys.repeat_interleave(groups, 1).transpose(0, 1)  # [H, n, D]
        values = values.repeat_interleave(groups, 1).transpose(0, 1)
        weights = torch.softmax(q[b][:, None] @ keys.transpose(1, 2) * scale, -1)
        out[b] = (weights @ values)[:, 0]


# llama_decode_layers_'s per-layer tensors: four vectors, then four matrices of four tensors.
DECODE_LAYER_VECTORS = ("input_norm", "post_norm", "q_norm", "k_norm")
DECODE_LAYER_MATRICES = ("qkv", "o", "gate_up", "down")
DECODE_MATRIX_TENSORS = ("qs", "d", "m", "bias")  # empty tensors where absent
TENSORS_PER_DECODE_LAYER = len(DECODE_LAYER_VECTORS) + 4 * len(DECODE_MATRIX_TENSORS)
MATRIX_KINDS = ("Q4_1", "Q8_0")  # a matrix's kind in `matrices`: its index here


def _present(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() else None


def _kind_linear(
    x: torch.Tensor, parts: list[torch.Tensor], kind: int, panel_min_tokens: int
) -> torch.Tensor:
    qs, d, m, bias = parts
    if kind == 0:
        y = q4_1_linear(x, qs, d, m, panel_min_tokens)
    else:
        y = q8_0_linear(x, qs, d, panel_min_tokens)
    return y if bias.numel() == 0 else y + bias


def llama_decode_layers_(
    x: torch.Tensor,  # [T, hidden]: the residual stream, updated in place
    tensors: list[torch.Tensor],  # TENSORS_PER_DECODE_LAYER per layer
    matrices: list[int],  # per layer and matrix: (kind, panel_min_tokens)
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    slots: torch.Tensor,  # [T]
    kv: torch.Tensor,  # [layers, 2, blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [T, W]: every row is one sequence's next token
    ctx_lens: torch.Tensor,  # [T]
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    windows: list[int],  # per layer, 0 = full attention
) -> None:
    """Every decoder layer of a decode-only step: the fused forward's layers, op for op."""
    num_tokens, per = x.shape[0], TENSORS_PER_DECODE_LAYER
    head_dim = kv.shape[-1]
    h = rms_norm(x, tensors[0], eps)
    for layer, window in enumerate(windows):
        t = tensors[layer * per : (layer + 1) * per]
        mats = [t[4 + 4 * i : 8 + 4 * i] for i in range(4)]
        info = matrices[layer * 8 : (layer + 1) * 8]
        key_cache, value_cache = kv[layer, 0], kv[layer, 1]
        slots_view = (-1, num_kv_heads, head_dim)
        qkv = _kind_linear(h, mats[0], info[0], info[1])
        qk = rope_write_kv_(
            qkv, cos, sin, slots, key_cache.view(slots_view), value_cache.view(slots_view),
            num_heads, num_kv_heads, _present(t[2]), _present(t[3]), eps,
        )  # fmt: skip
        attn = x.new_empty(num_tokens, num_heads, head_dim)
        paged_decode_(
            qk[:, :num_heads], key_cache, value_cache, block_tables, ctx_lens,
            head_dim**-0.5, window, attn,
        )  # fmt: skip
        o = _kind_linear(attn.view(num_tokens, -1), mats[1], info[2], info[3])
        h = add_rms_norm_(x, o, t[1], eps)
        r = _kind_linear(silu_mul(_kind_linear(h, mats[2], info[4], info[5])), mats[3], *info[6:])
        if layer + 1 < len(windows):
            h = add_rms_norm_(x, r, tensors[(layer + 1) * per], eps)
        else:
            x.add_(r)
