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
With ``PagedKVCache.decode_kernel`` (on CUDA by default, `--decode-attention`), decode tokens
instead attend in place through a Triton kernel (engine/triton_decode.py), all in one group and
with no block copied; prefill chunks stay as above.
Everything index-shaped is built once per step in ``AttentionMetadata.build`` from the
persistent block table of an ``InputBatch`` (engine/input_batch.py), uploaded in one copy, and
shared by layers.

NOTE (measured on this 2-core CPU, per layer, 256 decodes x ~190 positions): flex_attention over
the pool with a paged BlockMask (torch.compile, static shapes) took 3.3 ms on the tiny model vs
2.5 ms for block read + SDPA, 13.4 ms vs 19.6 ms on SmolLM2 shapes; but each new batch size costs
6-9 s of compilation, and dynamic shapes failed to compile (inductor C++ error). varlen_attn's
paged mode is flash-attention only (CUDA, fp16/bf16). So: block read + SDPA on every device.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from engine.input_batch import InputBatch
from engine.kv_cache import PagedKVCache
from engine.triton_decode import paged_decode_attention

ATTN_IMPLEMENTATION = "jitney_paged"
# A new decode group costs one more read + SDPA per layer; it pays when the padding it avoids
# exceeds about this many key positions. Measured on CPU (SmolLM2, mixed-64 trace, same process):
# 128 gave 123-147 tok/s against 117-127 for one padded batch; 32-64 and 256-2048 gained less.
DECODE_GROUP_COST_TOKENS = 128


@dataclass(slots=True)
class DecodeGroup:
    """Decode sequences (one new token each) attended together over `num_blocks` blocks each."""

    rows: torch.Tensor | slice  # their rows of T (a slice when contiguous)
    blocks: torch.Tensor  # [n * num_blocks] block ids; tables padded with (masked) stale ids
    members: slice  # their entries of AttentionMetadata.decode_ctx
    num_blocks: int
    min_len: int  # the shortest member's context


def group_decodes(ctx_lens: Sequence[int], cost: int = DECODE_GROUP_COST_TOKENS) -> list[list[int]]:
    """Split decode sequences (indices into `ctx_lens`) into groups of similar length: in order
    of length, a sequence starts a new group when joining would pad the group's members by more
    key positions than `cost`."""
    order = sorted(range(len(ctx_lens)), key=ctx_lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) * (ctx_lens[i] - ctx_lens[groups[-1][-1]]) <= cost:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with >1 new token: query rows [q_start, q_end), positions [start, ctx)."""

    q_start: int
    q_end: int
    start: int
    ctx: int  # start + n: keys at positions [0, ctx)
    blocks: torch.Tensor | None  # [ceil(ctx / block_size)] block ids; None when start == 0


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: slot where token t's K/V is written
    positions: torch.Tensor  # [T] int64: absolute position of token t
    logits_indices: torch.Tensor  # [S] int64: rows of T whose logits are wanted
    input_ids: torch.Tensor | None  # [T] int64, when build was given them
    block_size: int
    mask_dtype: torch.dtype  # the pool's dtype: queries, keys and masks are all cast to it
    # The sequences with exactly one new token, in groups of similar context length.
    decodes: list[DecodeGroup]
    decode_ctx: torch.Tensor  # [Bd] their context lengths, group after group
    prefills: list[PrefillChunk]
    # (chunk index, or -1 - g for decode group g; window) -> additive mask, or None when no
    # mask is needed. Filled for window None in build, for other windows by layer 0.
    masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)
    # window -> [Bd, keys] additive mask over every decode; each group's mask is a view of it.
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # [T] each token's row of the InputBatch block table (the CUDA-graph path copies rows).
    table_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @classmethod
    def build(
        cls,
        seqs: Sequence[tuple[int, int, Sequence[int]]],
        kv_cache: PagedKVCache,
        sample: Sequence[bool] | None = None,
        *,
        batch: InputBatch | None = None,
        keys: Sequence[Hashable] | None = None,
        input_ids: list[int] | None = None,
        prompt_rows: Sequence[tuple[int, int]] = (),
    ) -> AttentionMetadata:
        """``seqs[i] = (start_position, num_new_tokens, block_table)`` in packing order; block
        ``block_table[j]`` holds positions ``[j * block_size, (j + 1) * block_size)``. ``sample[i]``
        (default all True) says whether sequence i's last token gets logits. `batch` keeps the
        block tables between steps, keyed by ``keys[i]`` (default: a fresh batch, keys 0..B-1);
        `input_ids` [T] travel to the device in the same copy. `prompt_rows` (sequence i, k)
        also wants logits for its first k new tokens (prompt log-probs), after the sampled rows."""
        bs = kv_cache.block_size
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        num_seqs = len(seqs)
        if sample is not None and len(sample) != num_seqs:
            raise ValueError(f"sample has {len(sample)} flags for {num_seqs} sequences")
        batch = InputBatch(kv_cache.device) if batch is None else batch
        batch.begin_step()
        # The one pass per sequence in Python; the index math after it is numpy over [B] / [T].
        starts, lens, rows = [], [], []
        for i, (start, n, table) in enumerate(seqs):
            if n < 1 or start < 0 or len(table) * bs < start + n:
                raise ValueError(
                    f"sequence {i}: start {start}, {n} new tokens, {len(table)} blocks of {bs} "
                    "do not fit"
                )
            starts.append(start)
            lens.append(n)
            rows.append(batch.row(i if keys is None else keys[i], table))
        start_a, len_a, row_a = np.array(starts), np.array(lens), np.array(rows)
        cu = np.zeros(num_seqs + 1, dtype=np.int64)  # query rows of sequence i: [cu[i], cu[i + 1])
        np.cumsum(len_a, out=cu[1:])
        if cu[-1] == num_seqs:  # one token each (all decodes)
            positions, token_rows = start_a, row_a
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), len_a)
            positions = start_a[seq_of_token] + np.arange(cu[-1]) - cu[seq_of_token]
            token_rows = row_a[seq_of_token]
        logits_idx = cu[1:] - 1
        if sample is not None:
            logits_idx = logits_idx[np.asarray(sample, dtype=bool)]
        if prompt_rows:
            wanted = [cu[i] + np.arange(k) for i, k in prompt_rows]
            logits_idx = np.concatenate([logits_idx, *wanted])

        decodes = np.flatnonzero(len_a == 1)
        dec_ctx = start_a[decodes] + 1
        # Members in packing order within a group, so an all-decode group is a slice of rows.
        # The in-place kernel reads each row's own context, whatever the others': one group.
        if kv_cache.decode_kernel:
            groups = [decodes] if len(decodes) else []
        else:
            groups = [
                decodes[sorted(g)]
                for g in group_decodes(dec_ctx.tolist(), DECODE_GROUP_COST_TOKENS)
            ]
        members = np.concatenate(groups) if groups else decodes
        dev = batch.upload(
            input_ids or [],
            positions,
            token_rows,
            logits_idx,
            row_a[members],
            start_a[members] + 1,
            cu[members],
        )
        ids_t, pos_t, token_rows_t, logits_t, dec_rows_t, dec_ctx_t, dec_q_t = dev
        table = batch.block_table
        slot_mapping = table[token_rows_t, pos_t // bs] * bs + pos_t % bs

        dec_groups: list[DecodeGroup] = []
        at = 0
        for g in groups:
            min_len, max_len = int(start_a[g].min()) + 1, int(start_a[g].max()) + 1
            first, last = int(cu[g[0]]), int(cu[g[-1]])
            num_blocks = -(-max_len // bs)
            m = slice(at, at + len(g))
            dec_groups.append(
                DecodeGroup(
                    slice(first, last + 1) if last - first == len(g) - 1 else dec_q_t[m],
                    table[dec_rows_t[m], :num_blocks].reshape(-1),
                    m,
                    num_blocks,
                    min_len,
                )
            )
            at += len(g)
        prefills = [
            PrefillChunk(
                int(cu[i]),
                int(cu[i + 1]),
                starts[i],
                starts[i] + lens[i],
                table[rows[i], : -(-(starts[i] + lens[i]) // bs)] if starts[i] else None,
            )
            for i in np.flatnonzero(len_a > 1).tolist()
        ]
        meta = cls(
            slot_mapping=slot_mapping,
            positions=pos_t,
            logits_indices=logits_t,
            input_ids=ids_t if input_ids else None,
            block_size=bs,
            mask_dtype=kv_cache.spec.dtype,
            decodes=dec_groups,
            decode_ctx=dec_ctx_t,
            prefills=prefills,
            table_rows=token_rows_t,
        )
        for g in range(0 if kv_cache.decode_kernel else len(dec_groups)):
            meta.decode_mask(g, None)
        for i in range(len(prefills)):
            meta.prefill_mask(i, None)
        return meta

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """0 where visible, -inf elsewhere (SDPA measured ~15% faster than with a bool mask)."""
        mask = torch.zeros(visible.shape, dtype=self.mask_dtype, device=visible.device)
        return mask.masked_fill_(~visible, float("-inf"))

    def decode_mask(self, g: int, window: int | None) -> torch.Tensor | None:
        """[n, 1, 1, keys] for decode group g: key k visible iff ctx - window <= k < ctx;
        None = all visible. One mask over every decode serves all groups (a view of it each)."""
        key = (-1 - g, window)
        if key not in self.masks:
            group = self.decodes[g]
            num_keys = group.num_blocks * self.block_size
            if group.min_len == num_keys and (window is None or window >= num_keys):
                self.masks[key] = None  # every member's context is exactly the blocks read
            else:
                if window not in self.decode_masks:
                    ctx = self.decode_ctx[:, None]
                    longest = max(d.num_blocks for d in self.decodes) * self.block_size
                    k = torch.arange(longest, device=ctx.device)[None, :]
                    visible = k < ctx
                    if window is not None:
                        visible &= k >= ctx - window
                    self.decode_masks[window] = self._additive(visible)
                view = self.decode_masks[window][group.members, :num_keys]
                self.masks[key] = view[:, None, None, :]
        return self.masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[n, keys] for chunk i: query at position p sees keys in (p - window, p]; None =
        causal over the chunk's own fresh K/V."""
        key = (i, window)
        if key not in self.masks:
            c = self.prefills[i]
            if c.blocks is None and (window is None or window >= c.ctx):
                self.masks[key] = None
            else:
                device = self.slot_mapping.device
                num_keys = c.ctx if c.blocks is None else c.blocks.numel() * self.block_size
                q = torch.arange(c.start, c.ctx, device=device)[:, None]
                k = torch.arange(num_keys, device=device)[None, :]
                visible = k <= q
                if window is not None:
                    visible &= k > q - window
                self.masks[key] = self._additive(visible)
        return self.masks[key]


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
    # [T, kv_heads, d] views of this step's fresh K/V
    cache.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))

    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    out = query.new_empty(num_tokens, num_heads, head_dim)

    queries = query[0].transpose(0, 1)  # [T, heads, d]
    decode = _decode_in_place if cache.decode_kernel else _decode_gathered
    decode(meta, cache, layer, queries, out, scaling, window)

    for i, c in enumerate(meta.prefills):
        q = query[:, :, c.q_start : c.q_end]  # [1, heads, n, d]
        if c.blocks is None:  # start == 0: the context is exactly this chunk's fresh K/V
            k = key[:, :, c.q_start : c.q_end].to(meta.mask_dtype)
            v = value[:, :, c.q_start : c.q_end].to(meta.mask_dtype)
        else:
            k, v = cache.read_blocks(layer, c.blocks)
            k = k.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
            v = v.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
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
    return out.unsqueeze(0), None


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
            k.view(shape).transpose(1, 2),  # [n, kv_heads, keys, d], strided: no copy
            v.view(shape).transpose(1, 2),
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
    """Every decode group through engine/triton_decode.py: K/V read where they lie."""
    scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
    for group in meta.decodes:
        rows = out[group.rows] if isinstance(group.rows, slice) else None  # a view: no copy
        o = paged_decode_attention(
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


_LOGITS_TO_KEEP: dict[type, bool] = {}


def model_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor | None,
    metadata: AttentionMetadata,
    kv_cache: PagedKVCache,
) -> torch.Tensor:
    """One packed step: ``input_ids``/``positions`` are [T] (or [1, T]; positions None = the
    metadata's). Returns logits ``[S, vocab]`` for ``metadata.logits_indices`` only."""
    ids = input_ids.reshape(1, -1)
    pos = (metadata.positions if positions is None else positions).reshape(1, -1)
    cls = type(model)
    if cls not in _LOGITS_TO_KEEP:
        _LOGITS_TO_KEEP[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    extra = {"logits_to_keep": metadata.logits_indices} if _LOGITS_TO_KEEP[cls] else {}
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            attn_metadata=metadata,
            kv_cache=kv_cache,
            **extra,
        )
    logits = out.logits[0]
    return logits if extra else logits[metadata.logits_indices]
