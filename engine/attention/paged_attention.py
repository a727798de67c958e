"""Paged attention for stock transformers decoders: one forward over a packed batch of sequences.

A step packs every scheduled token of B sequences into one ``[1, T]`` row, sequence after
sequence, at absolute positions ``[start_i, start_i + n_i)``. The model runs with
``attn_implementation="jitney_paged"`` and two extra keyword arguments,
``attn_metadata=AttentionMetadata`` and ``kv_cache=PagedKVCache``, which transformers (5.x) forwards
untouched to ``paged_attention_forward`` in every layer. That function writes the step's K/V at
``slot_mapping`` and attends each sequence over its own blocks only, positions ``[0, ctx_i)``:
- decode sequences (one new token) in groups of similar context length: per group one read of
  the members' blocks (``PagedKVCache.read_blocks``, whole blocks into a reused workspace) and
  one SDPA over the group padded to its longest table, with GQA folded into the query axis
  (``[Bd, kv_heads, groups, d]``) so K/V are never repeated. Grouping bounds the padding a mixed
  batch would otherwise compute (short sequences padded to the longest one);
- longer chunks one by one: SDPA with ``is_causal`` when the chunk starts at position 0 (its own
  fresh K/V are the whole context), else an explicit ``[n, keys]`` mask over its blocks.
With ``PagedKVCache.decode_kernel`` (`--decode-attention`), decode tokens instead attend in place,
all in one group and with no block copied: through a Triton kernel on CUDA
(engine/attention/triton_decode.py), through the C++ kernel on the CPU
(engine/attention/native_decode.py); prefill chunks stay as above. `attend` is the part after
the K/V write, for a forward that writes the cache itself (engine/models/llama.py).
Everything index-shaped is built once per step in ``AttentionMetadata.build``
(engine/attention/step_inputs.py) and shared by layers.

NOTE (measured on this 2-core CPU, per layer, 256 decodes x ~190 positions): flex_attention over
the pool with a paged BlockMask (torch.compile, static shapes) took 3.3 ms on the tiny model vs
2.5 ms for block read + SDPA, 13.4 ms vs 19.6 ms on SmolLM2 shapes; but each new batch size costs
6-9 s of compilation, and dynamic shapes failed to compile (inductor C++ error). varlen_attn's
paged mode is flash-attention only (CUDA, fp16/bf16). So: block read + SDPA on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from engine.attention.native_decode import native_decode_attention
from engine.attention.step_inputs import AttentionMetadata
from engine.attention.triton_decode import paged_decode_attention
from engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "jitney_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, d]
    key: torch.Tensor,  # [1, kv_heads, T, d]
    value: torch.Tensor,  # [1, kv_heads, T, d]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface; returns ``([1, T, heads, d], None)`` like sdpa does."""
    meta, cache = kwargs.get("attn_metadata"), kwargs.get("kv_cache")
    if not isinstance(meta, AttentionMetadata) or not isinstance(cache, PagedKVCache):
        raise TypeError("jitney_paged attention needs attn_metadata= and kv_cache= in model(...)")
    if query.shape[0] != 1:
        raise ValueError(f"jitney_paged expects one packed row, got batch {query.shape[0]}")
    if kwargs.get("softcap") is not None or hasattr(module, "sinks"):
        raise NotImplementedError("jitney_paged supports neither logit softcap nor attention sinks")
    # Qwen2/Qwen3/Mistral pass sliding_window (None on full-attention layers); Llama passes none.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    window = None if window is None else int(window)  # type: ignore[call-overload]
    layer = module.layer_idx
    keys, values = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, d] views
    cache.write(layer, meta.slot_mapping, keys, values)
    out = attend(meta, cache, layer, query[0].transpose(0, 1), keys, values, scaling, window)
    return out.unsqueeze(0), None


def attend(
    meta: AttentionMetadata,
    cache: PagedKVCache,
    layer: int,
    queries: torch.Tensor,  # [T, heads, d]
    keys: torch.Tensor,  # [T, kv_heads, d]: this step's, already written to the cache
    values: torch.Tensor,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """[T, heads, d]: every token of the step attending its own sequence's context."""
    num_tokens, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    groups = num_heads // num_kv_heads
    out = queries.new_empty(num_tokens, num_heads, head_dim)
    decode = _decode_in_place if cache.decode_kernel else _decode_gathered
    decode(meta, cache, layer, queries, out, scaling, window)

    for i, c in enumerate(meta.prefills):
        q = queries[c.q_start : c.q_end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if c.blocks is None:  # start == 0: the context is exactly this chunk's fresh K/V
            k = cache.as_read(keys[c.q_start : c.q_end]).transpose(0, 1).unsqueeze(0)
            v = cache.as_read(values[c.q_start : c.q_end]).transpose(0, 1).unsqueeze(0)
        else:
            k, v = cache.read_blocks(layer, c.blocks)
            k = k.view(1, -1, num_kv_heads, head_dim).transpose(1, 2).to(meta.mask_dtype)
            v = v.view(1, -1, num_kv_heads, head_dim).transpose(1, 2).to(meta.mask_dtype)
        mask = meta.prefill_mask(i, window)
        q = q.to(meta.mask_dtype)
        if groups > 1 and not sdpa_takes_gqa(q, mask):
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=k.shape[1] != num_heads,
        )
        out[c.q_start : c.q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out


def sdpa_takes_gqa(query: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether SDPA should get K/V once per KV head (`enable_gqa`) rather than repeated per
    query head. On CUDA only the flash kernel takes `enable_gqa`, and flash takes neither a mask
    nor float32: such a call would fall back to the math kernel, which holds float32 scores for
    every head (n x keys each: GBs for a long chunk after a cached prefix), where repeated K/V
    run in the memory-efficient kernel. On the CPU `enable_gqa` runs fused, 10-25 % faster than
    repeating (measured for masked chunks of SmolLM2's and a 32-head layout)."""
    return not query.is_cuda or (mask is None and query.dtype != torch.float32)


def _decode_gathered(
    meta: AttentionMetadata,
    cache: PagedKVCache,
    layer: int,
    queries: torch.Tensor,  # [T, heads, d]
    out: torch.Tensor,  # [T, heads, d]
    scaling: float | None,
    window: int | None,
) -> None:
    """Every decode group: its blocks copied into the workspace, then one SDPA over them."""
    num_heads, head_dim = queries.shape[1:]
    num_kv_heads = cache.spec.num_kv_heads
    groups = num_heads // num_kv_heads
    for g, group in enumerate(meta.decodes):
        q = queries[group.rows]  # [n, heads, d]
        num_dec = q.shape[0]
        # Head h uses kv head h // groups, so groups fold into the query-length axis: no repeat.
        q = q.reshape(num_dec, num_kv_heads, groups, head_dim).to(meta.mask_dtype)
        k, v = cache.read_blocks(layer, group.blocks)  # [n * blocks, block_size, kv_heads, d]
        shape = (num_dec, -1, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q,
            # [n, kv_heads, keys, d], strided: no copy (but the widening of a 16-bit pool)
            k.view(shape).transpose(1, 2).to(meta.mask_dtype),
            v.view(shape).transpose(1, 2).to(meta.mask_dtype),
            attn_mask=meta.decode_mask(g, window),
            scale=scaling,
        )
        out[group.rows] = o.reshape(num_dec, num_heads, head_dim).to(out.dtype)


def _decode_in_place(
    meta: AttentionMetadata,
    cache: PagedKVCache,
    layer: int,
    queries: torch.Tensor,  # [T, heads, d]
    out: torch.Tensor,  # [T, heads, d]
    scaling: float | None,
    window: int | None,
) -> None:
    """Every decode group through the in-place kernel: K/V read where they lie."""
    scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
    kernel = native_decode_attention if cache.decode_kernel == "native" else paged_decode_attention
    for group in meta.decodes:
        rows = out[group.rows] if isinstance(group.rows, slice) else None  # a view: no copy
        o = kernel(
            queries[group.rows],
            cache.key_cache[layer],
            cache.value_cache[layer],
            group.blocks.view(-1, group.num_blocks),
            meta.decode_ctx[group.members],
            scale,
            window,
            out=rows,
        )
        if rows is None:
            out[group.rows] = o


def register() -> None:
    """Make ``attn_implementation="jitney_paged"`` known to transformers (idempotent).

    NOTE: deliberately no ``AttentionMaskInterface`` entry. For an implementation absent from the
    mask registry, transformers (>= 4.53, checked in 5.17 and 5.24) returns
    ``attention_mask=None`` straight away; registering even a ``lambda: None`` makes it first scan
    position_ids for packed sequences and compose mask functions on every forward (measured 274 us
    vs 14 us per mask, i.e. ~7% of a 32-sequence decode step on the tiny model).
    ``test_model_builds_no_mask_for_the_packed_row`` guards it.
    """
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def use_paged_attention(model: torch.nn.Module) -> None:
    """Switch a loaded transformers model to the paged attention function."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]
