"""The jitney:: ops in pure torch: the quantized linears dequantize to float32, then F.linear /
indexing; the layer ops are the few torch ops each stands for.

The fallback where the C++ kernels cannot be built, and the definition of what they compute; the
packed layout of the quantized weights is engine/kernels/block_types.py's (`pack` / `unpack`;
engine/kernels/csrc/blocks.h reads the same bytes), whose `dequantize` is bit-exact with gguf's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.block_types import BLOCK, block_type, dequantize, effective_scales, unpack
from engine.kv_cache import to_pool


def quant_linear(
    x: torch.Tensor,
    blocks: list[torch.Tensor],
    kinds: list[int],
    rows: list[int],
    batched_min_tokens: int,
) -> torch.Tensor:
    """x @ W.T of a projection whose parts (each in its own block type) sit side by side."""
    weights = [dequantize(b, block_type(k), n) for b, k, n in zip(blocks, kinds, rows, strict=True)]
    return F.linear(x, torch.cat(weights) if len(weights) > 1 else weights[0])


def quantize_activations(
    x: torch.Tensor, digits: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 [T, K] -> (hi, lo int8 [T, K], scale float32 [T, K/32]): each block of 32 as int8
    digits, x ~ scale * (254 hi + lo), or with one digit x ~ scale * hi (lo zero) (the integer
    one passes' activations, csrc/quant_vnni.cpp)."""
    t, k = x.shape
    blocks = x.reshape(t, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # (true divisions: `127 / amax` or `amax / 127` would multiply by a reciprocal, an ulp apart)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    v = blocks * inv.unsqueeze(-1)
    hi = v.round()
    scale = amax.div(torch.full_like(amax, 127))
    if digits == 1:
        return hi.to(torch.int8).reshape(t, k), torch.zeros(t, k, dtype=torch.int8), scale
    lo = ((v - hi) * 254).round()
    scale = scale.div(torch.full_like(amax, 254))
    return hi.to(torch.int8).reshape(t, k), lo.to(torch.int8).reshape(t, k), scale


def quant_linear_int8_activations(
    x: torch.Tensor, blocks: torch.Tensor, kind: str, rows: int, digits: int = 2
) -> torch.Tensor:
    """What the integer one-pass kernels compute, in float64: per sub-block, its scale * the
    activations' scale * (the exact integer dot of the signed quants u - offset and 254 hi + lo,
    or hi), plus the block's minimum * the block sum of the float activations (two digits) or of
    the rounded ones, scale * sum(hi) (one digit)."""
    bt = block_type(kind)
    f = unpack(blocks, bt, rows)
    scales, minimum = effective_scales(f, bt)
    quants = f.q.double() - bt.offset
    hi, lo, xscale = quantize_activations(x, digits)
    values = hi.double() * 254 + lo.double() if digits == 2 else hi.double()
    t, k = x.shape
    per = BLOCK // bt.subs
    y = torch.zeros(t, rows, dtype=torch.float64)
    for b in range(k // BLOCK):
        for s in range(bt.subs):
            cols = slice(b * BLOCK + s * per, b * BLOCK + (s + 1) * per)
            dot = values[:, cols] @ quants[:, cols].T  # exact: integers below 2^53
            y += dot * (xscale[:, b : b + 1].double() * scales[:, b * bt.subs + s].double())
        if minimum is not None:
            cols = slice(b * BLOCK, (b + 1) * BLOCK)
            if digits == 2:
                total = x[:, cols].double().sum(dim=1, keepdim=True)
            else:
                total = xscale[:, b : b + 1].double() * hi[:, cols].double().sum(
                    dim=1, keepdim=True
                )
            y += total * minimum[:, b].double()
    return y


def quant_embedding(ids: torch.Tensor, blocks: torch.Tensor, kind: int, rows: int) -> torch.Tensor:
    flat = ids.reshape(-1).long()
    if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < rows):
        raise IndexError(f"quant_embedding: ids out of range [0, {rows})")
    table = dequantize(blocks, block_type(kind), rows)
    return table[flat].view(*ids.shape, table.shape[1])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> int64 [N]: each row's first largest value (NaN counting as largest)."""
    return x.argmax(dim=-1)


def sample_rows(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """[N, V] logits (temperature applied) -> int64 [N]: each row's top-k cut (0: none), then
    its top-p cut (>= 1: none), and the first token whose cumulative mass exceeds u times the
    kept mass (u in [0, 1), one per row)."""
    x = (
        cut_asking_rows(x, top_k, top_p)
        if x.device.type == "cpu"
        else cut_every_row(x, top_k, top_p)
    )
    cdf = x.softmax(dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first token whose mass exceeds it has p > 0.
    target = torch.minimum(u.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def cut_asking_rows(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`x` with each row's top-k and top-p cuts (`_cut`), made only on the rows that ask:
    rows with a top-k cut order only their k largest logits; top-p alone needs a full sort.
    It reads values back to the host (which rows, the largest k): free on the CPU."""
    vocab = x.shape[1]
    cut_k = (top_k > 0) & (top_k < vocab)
    x = x.clone()
    for rows in (cut_k.nonzero().flatten(), ((top_p < 1) & ~cut_k).nonzero().flatten()):
        if rows.numel():
            x[rows] = _cut(x[rows], top_k[rows], top_p[rows])
    return x


def cut_every_row(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """cut_asking_rows's result without reading any value back to the host: on a GPU each read
    would wait for the step's whole forward. Every row is cut over a full sort, and the cut is
    kept on the rows that ask."""
    vocab = x.shape[1]
    asks = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    return torch.where(asks.unsqueeze(1), _cut(x, top_k, top_p, largest=vocab), x)


def _cut(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, largest: int | None = None
) -> torch.Tensor:
    """Rows of logits with cut tokens at -inf. top-k keeps the k largest, top-p then the fewest
    of those, largest first, whose mass reaches top_p (the top token always stays). The cut is
    a logit threshold, so tokens tied with the last one kept stay too, and the sort order of
    ties does not matter. `largest`: how many of each row's largest to order (None: the largest
    k, read from `top_k`)."""
    vocab = x.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab) - 1  # the k-th largest's index
    if largest is None:
        largest = int(k.max()) + 1
    if largest < vocab:
        ordered = x.topk(largest, dim=-1).values
    else:
        ordered = x.sort(dim=-1, descending=True).values
    kth = ordered.gather(1, k.unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    # The mass is over every survivor of top-k, the tokens tied with the k-th that fall past
    # `largest` included (the C++ kernel's kept mass): a softmax of `ordered` would drop them.
    top = ordered[:, :1]
    total = (x - top).exp().masked_fill(x < kth, 0).sum(dim=-1, keepdim=True)
    probs = (ordered - top).exp() / total
    # top_p 1 is no cut: float mass can reach 1 before the last tokens and must not drop them.
    mass = torch.where(top_p < 1, top_p, torch.full_like(top_p, float("inf"))).unsqueeze(1)
    keep = (probs.cumsum(dim=-1) - probs < mass) & (ordered > float("-inf"))
    threshold = ordered.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    return x.masked_fill(x < threshold, float("-inf"))


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


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2F] -> gelu_tanh(gate) * up (Gemma's GeGLU), gate and up its two halves."""
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_write_kv_(
    qkv: torch.Tensor,  # [T, (H + 2 KV) * D]
    cos: torch.Tensor,  # [T, R], both halves of the rotated width R <= D (0: no rotation)
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
    """[T, H + KV, D]: Q's and K's heads, each normed (where a weight is given) and its first R
    elements rotated by its token's angles (Phi's partial rotation: the rest kept; SmolLM3's
    layers without RoPE: R = 0); K and V written to their slots."""
    num_tokens = qkv.shape[0]
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, -1)
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    width = cos.shape[1]
    half = width // 2
    qk = torch.cat([q, k], dim=1)
    c, s = cos[:, None], sin[:, None]
    rot = qk[..., :width]
    rot = rot * c + torch.cat([-rot[..., half:], rot[..., :half]], dim=-1) * s
    qk = torch.cat([rot, qk[..., width:]], dim=-1)
    key_slots[slots] = to_pool(qk[:, num_heads:], key_slots.dtype)  # 16-bit: rounded (to_pool)
    value_slots[slots] = to_pool(v, value_slots.dtype)
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
    """Each sequence's query over its own keys, gathered from its blocks (a bfloat16 or float16
    pool widened to the query's float32)."""
    num_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(ctx_lens[b])
        lo = max(0, n - window) if window > 0 else 0
        keys = key_cache[block_tables[b]].flatten(0, 1)[lo:n].to(q.dtype)  # [n, KV, D]
        values = value_cache[block_tables[b]].flatten(0, 1)[lo:n].to(q.dtype)
        groups = num_heads // num_kv_heads
        keys = keys.repeat_interleave(groups, 1).transpose(0, 1)  # [H, n, D]
        values = values.repeat_interleave(groups, 1).transpose(0, 1)
        weights = torch.softmax(q[b][:, None] @ keys.transpose(1, 2) * scale, -1)
        out[b] = (weights @ values)[:, 0]


# An adapter's pack (csrc/ops.h, engine/lora/adapter_set.py KernelPack): int8 weights, float32
# scales and a record per update of LORA_RECORD_INTS ints: parts (0: none), K, R, A's offset
# and its scales', then per part its B's offset and its scales', rank, column start, rank
# start and width.
LORA_PACK_TENSORS = 3
LORA_RECORD_INTS = 5 + 6 * 3


def lora_add_(
    y: torch.Tensor,  # [T, out] float32, updated in place
    x: torch.Tensor,  # [T, in] float32
    rows: list[torch.Tensor],  # per adapter group: int64 [n], its rows of y and x
    packs: list[torch.Tensor],  # per group: its adapter's pack, LORA_PACK_TENSORS tensors
    entries: list[int],  # per group: the record of this projection's update
) -> None:
    """Every group's low-rank update of a (fused) projection, added to its rows of y
    (csrc/lora_add.cpp: the layout is engine/lora/adapter_set.py's)."""
    for g, index in enumerate(rows):
        weights, scales, records = packs[g * LORA_PACK_TENSORS : (g + 1) * LORA_PACK_TENSORS]
        rec = records[entries[g]].tolist()
        parts, k, r_total, a_at, a_scale_at = rec[:5]
        if parts == 0:
            continue
        a = weights[a_at : a_at + r_total * k].view(r_total // 16, k // 4, 64)
        low = (x[index] @ a_from_tiles(a)[:, : x.shape[1]].T) * scales[a_scale_at:][:r_total]
        for p in range(parts):
            b_at, b_scale_at, r, start, rank_start, out = rec[5 + 6 * p : 11 + 6 * p]
            chunks = -(-out // 32)
            b = weights[b_at : b_at + chunks * r * 32].view(chunks, r // 4, 128)
            part = b_from_chunks(b, out) * scales[b_scale_at : b_scale_at + r]  # [out, r]
            y[index, start : start + out] += low[:, rank_start : rank_start + r] @ part.T


def a_from_tiles(a: torch.Tensor) -> torch.Tensor:
    """[R / 16, K / 4, 64] -> [R, K] float32: rank 16 t + l, input 4 g + i at a[t, g, 4 l + i]."""
    tiles, groups = a.shape[:2]
    return (
        a.reshape(tiles, groups, 16, 4).permute(0, 2, 1, 3).reshape(tiles * 16, groups * 4).float()
    )


def b_from_chunks(b: torch.Tensor, out: int) -> torch.Tensor:
    """[C, r / 4, 128] -> [out, r] float32: output 32 c + l, rank 4 g + i at b[c, g, 4 l + i]."""
    chunks, groups = b.shape[:2]
    full = b.reshape(chunks, groups, 32, 4).permute(0, 2, 1, 3).reshape(chunks * 32, groups * 4)
    return full[:out].float()


# llama_decode_layers_'s per-layer tensors: four vectors, then four matrices of four tensors.
DECODE_LAYER_VECTORS = ("input_norm", "post_norm", "q_norm", "k_norm")
DECODE_LAYER_MATRICES = ("qkv", "o", "gate_up", "down")
# Per matrix: its bias (empty where absent), then the blocks of each part (empty past the last).
DECODE_MAX_PARTS = 3
DECODE_MATRIX_TENSORS = 1 + DECODE_MAX_PARTS
TENSORS_PER_DECODE_LAYER = len(DECODE_LAYER_VECTORS) + 4 * DECODE_MATRIX_TENSORS
# Per matrix, in `matrices`: its number of parts, batched_min_tokens, each part slot's kind, each
# part slot's rows (0 past the last part).
DECODE_MATRIX_INTS = 2 + 2 * DECODE_MAX_PARTS


def _present(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() else None


def _kind_linear(x: torch.Tensor, tensors: list[torch.Tensor], ints: list[int]) -> torch.Tensor:
    bias, parts, slots = tensors[0], ints[0], DECODE_MAX_PARTS
    kinds, rows = ints[2 : 2 + parts], ints[2 + slots : 2 + slots + parts]
    y = quant_linear(x, tensors[1 : 1 + parts], kinds, rows, ints[1])
    return y if bias.numel() == 0 else y + bias


def llama_decode_layers_(
    x: torch.Tensor,  # [T, hidden]: the residual stream, updated in place
    tensors: list[torch.Tensor],  # TENSORS_PER_DECODE_LAYER per layer
    matrices: list[int],  # per layer and matrix: DECODE_MATRIX_INTS
    cos: list[torch.Tensor],  # per rotary table: [T, R] (engine/models/rotary.py)
    sin: list[torch.Tensor],
    slots: torch.Tensor,  # [T]
    kv: torch.Tensor,  # [layers, 2, blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [T, W]: every row is one sequence's next token
    ctx_lens: torch.Tensor,  # [T]
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    windows: list[int],  # per layer, 0 = full attention
    rope_tables: list[int],  # per layer: its table in cos/sin
    out_norms: list[torch.Tensor],  # none, or per layer the attention's and the MLP's (Gemma)
    scale: float,  # the attention scores' scale
    activation: int,  # the MLP's gate: 0 SiLU, 1 GELU-tanh (engine/models/families.py)
    lora_rows: list[torch.Tensor] = (),  # type: ignore[assignment]  # per adapter group: rows
    lora: list[torch.Tensor] = (),  # type: ignore[assignment]  # per group: its adapter's pack
) -> None:
    """Every decoder layer of a decode-only step: the fused forward's layers, op for op, each
    matrix's LoRA updates added for their groups' rows."""
    num_tokens, per = x.shape[0], TENSORS_PER_DECODE_LAYER
    head_dim = kv.shape[-1]
    nt, ni = DECODE_MATRIX_TENSORS, DECODE_MATRIX_INTS

    def linear(y_in: torch.Tensor, layer: int, matrix: int, mats, ints) -> torch.Tensor:
        y = _kind_linear(y_in, mats[matrix], ints[matrix])
        lora_add_(y, y_in, list(lora_rows), list(lora), [layer * 4 + matrix] * len(lora_rows))
        return y

    h = rms_norm(x, tensors[0], eps)
    for layer, window in enumerate(windows):
        t = tensors[layer * per : (layer + 1) * per]
        mats = [t[4 + nt * i : 4 + nt * (i + 1)] for i in range(4)]
        info = matrices[layer * 4 * ni : (layer + 1) * 4 * ni]
        ints = [info[ni * i : ni * (i + 1)] for i in range(4)]
        key_cache, value_cache = kv[layer, 0], kv[layer, 1]
        slots_view = (-1, num_kv_heads, head_dim)
        qkv = linear(h, layer, 0, mats, ints)
        table = rope_tables[layer]
        qk = rope_write_kv_(
            qkv, cos[table], sin[table], slots, key_cache.view(slots_view),
            value_cache.view(slots_view), num_heads, num_kv_heads, _present(t[2]),
            _present(t[3]), eps,
        )  # fmt: skip
        attn = x.new_empty(num_tokens, num_heads, head_dim)
        paged_decode_(
            qk[:, :num_heads], key_cache, value_cache, block_tables, ctx_lens, scale, window, attn
        )
        o = linear(attn.view(num_tokens, -1), layer, 1, mats, ints)
        if out_norms:
            o = rms_norm(o, out_norms[2 * layer], eps)
        h = add_rms_norm_(x, o, t[1], eps)
        gate = (silu_mul, gelu_tanh_mul)[activation]
        r = linear(gate(linear(h, layer, 2, mats, ints)), layer, 3, mats, ints)
        if out_norms:
            r = rms_norm(r, out_norms[2 * layer + 1], eps)
        if layer + 1 < len(windows):
            h = add_rms_norm_(x, r, tensors[(layer + 1) * per], eps)
        else:
            x.add_(r)
