"""Paged attention for stock transformers decoders: one forward over a packed batch of sequences.

A step packs every scheduled token of B sequences into one ``[1, T]`` row; sequence ``i`` owns
rows ``[cu_seqlens_q[i], cu_seqlens_q[i + 1])`` at absolute positions ``[start_i, start_i + n_i)``.
The model runs with ``attn_implementation="jitney_paged"`` and two extra keyword arguments,
``attn_metadata=AttentionMetadata`` and ``kv_cache=PagedKVCache``, which transformers (5.x) forwards
untouched to ``paged_attention_forward`` in every layer. That function writes the step's K/V at
``slot_mapping`` and attends each sequence over its own blocks only, positions ``[0, ctx_i)``:
- decode sequences (one new token) in groups of similar context length: per group one gather +
  one SDPA over a batch padded to the group's longest context, with GQA folded into the query
  axis (``[Bd, kv_heads, groups, d]``) so K/V are never repeated. Grouping bounds the padding a
  mixed batch would otherwise compute (short sequences padded to the longest one);
- longer chunks one by one: SDPA with ``is_causal`` when the chunk starts at position 0 (its own
  fresh K/V are the whole context), else an explicit ``[n, ctx]`` mask over the gathered context.
Everything index-shaped is built once per step in ``AttentionMetadata.build`` and shared by layers.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import transformers

from engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "jitney_paged"
# A new decode group costs one more gather + SDPA per layer; it pays when the padding it avoids
# exceeds about this many key positions. Measured on CPU (SmolLM2, mixed-64 trace, same process):
# 128 gave 123-147 tok/s against 117-127 for one padded batch; 32-64 and 256-2048 gained less.
DECODE_GROUP_COST_TOKENS = 128


@dataclass(slots=True)
class DecodeGroup:
    """Decode sequences (one new token each) attended together, keys padded to `max_len`."""

    rows: torch.Tensor | slice  # their rows of T (a slice when contiguous)
    gather: torch.Tensor  # [n * kv_heads * max_len] pool rows; pads -> block 0
    ctx: torch.Tensor  # [n] int64 context lengths
    max_len: int
    min_len: int


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
    gather: torch.Tensor | None  # [kv_heads * ctx] pool rows; None when start == 0 (fresh K/V)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: slot where token t's K/V is written
    positions: torch.Tensor  # [T] int64: absolute position of token t
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32: start + n, keys each sequence attends to
    block_tables: torch.Tensor  # [B, max_blocks] int32, right-padded with 0 (never read)
    logits_indices: torch.Tensor  # [S] int64: rows of T whose logits are wanted
    block_size: int
    num_kv_heads: int
    # The sequences with exactly one new token, in groups of similar context length.
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # (chunk index, or -1 - g for decode group g; window) -> bool mask (True = attend), or None
    # when no mask is needed. Filled for window None in build, for other windows by layer 0.
    masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @classmethod
    def build(
        cls,
        seqs: Sequence[tuple[int, int, Sequence[int]]],
        kv_cache: PagedKVCache,
        sample: Sequence[bool] | None = None,
    ) -> AttentionMetadata:
        """``seqs[i] = (start_position, num_new_tokens, block_table)`` in packing order; block
        ``block_table[j]`` holds positions ``[j * block_size, (j + 1) * block_size)``. ``sample[i]``
        (default all True) says whether sequence i's last token gets logits."""
        bs, kvh, device = kv_cache.block_size, kv_cache.spec.num_kv_heads, kv_cache.device
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        starts = [s for s, _, _ in seqs]
        lens = [n for _, n, _ in seqs]
        for i, (start, n, table) in enumerate(seqs):
            if n < 1 or start < 0 or len(table) * bs < start + n:
                raise ValueError(
                    f"sequence {i}: start {start}, {n} new tokens, {len(table)} blocks of {bs} "
                    "do not fit"
                )
        num_seqs, max_blocks = len(seqs), max(len(t) for _, _, t in seqs)
        cu_list = [0, *itertools.accumulate(lens)]  # query rows of sequence i: [cu[i], cu[i + 1])
        tables = torch.tensor([[*t, *[0] * (max_blocks - len(t))] for _, _, t in seqs])
        n_t, start_t = torch.tensor(lens), torch.tensor(starts)
        ctx_t = start_t + n_t
        cu = torch.tensor(cu_list)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), n_t)
        positions = start_t[seq_of_token] + torch.arange(cu_list[-1]) - cu[seq_of_token]
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        sample = [True] * num_seqs if sample is None else list(sample)
        if len(sample) != num_seqs:
            raise ValueError(f"sample has {len(sample)} flags for {num_seqs} sequences")
        logits_idx = torch.tensor([cu_list[i + 1] - 1 for i in range(num_seqs) if sample[i]])

        def gather_rows(seq_ids: list[int], length: int) -> torch.Tensor:
            """Pool rows of positions [0, length) of these sequences, flat [seq, head, pos]."""
            pos = torch.arange(length)
            slot = tables[seq_ids][:, pos // bs] * bs + pos % bs  # [n, length]
            return (slot[:, None, :] * kvh + torch.arange(kvh)[None, :, None]).flatten()

        def dev(x: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return x.to(device=device, dtype=dtype)

        def decode_group(members: list[int]) -> DecodeGroup:
            rows = [cu_list[i] for i in members]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            max_len = max(starts[i] for i in members) + 1
            return DecodeGroup(
                slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device),
                dev(gather_rows(members, max_len)),
                dev(ctx_t[members]),
                max_len,
                min(starts[i] for i in members) + 1,
            )

        dec = [i for i in range(num_seqs) if lens[i] == 1]
        groups = group_decodes([starts[i] + 1 for i in dec], DECODE_GROUP_COST_TOKENS)
        decodes = [decode_group(sorted(dec[j] for j in g)) for g in groups]
        prefills = [
            PrefillChunk(
                cu_list[i],
                cu_list[i + 1],
                starts[i],
                starts[i] + lens[i],
                gather_rows([i], starts[i] + lens[i]).to(device) if starts[i] else None,
            )
            for i in range(num_seqs)
            if lens[i] > 1
        ]
        meta = cls(
            slot_mapping=dev(slots),
            positions=dev(positions),
            cu_seqlens_q=dev(cu, torch.int32),
            context_lens=dev(ctx_t, torch.int32),
            block_tables=dev(tables, torch.int32),
            logits_indices=dev(logits_idx),
            block_size=bs,
            num_kv_heads=kvh,
            decodes=decodes,
            prefills=prefills,
        )
        for g in range(len(decodes)):
            meta.decode_mask(g, None)
        for i in range(len(prefills)):
            meta.prefill_mask(i, None)
        return meta

    def decode_mask(self, g: int, window: int | None) -> torch.Tensor | None:
        """[n, 1, 1, max_len] for decode group g: key k visible iff ctx - window <= k < ctx;
        None = all visible."""
        key, group = (-1 - g, window), self.decodes[g]
        uniform = group.min_len == group.max_len
        if uniform and (window is None or window >= group.max_len):
            return None  # every key of the padded group is visible to every query
        if key not in self.masks:
            ctx = group.ctx[:, None]
            k = torch.arange(group.max_len, device=ctx.device)[None, :]
            mask = k < ctx
            if window is not None:
                mask &= k >= ctx - window
            self.masks[key] = mask[:, None, None, :]
        return self.masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[n, ctx] for chunk i: query at position p sees keys in (p - window, p]; None = causal."""
        key = (i, window)
        if key not in self.masks:
            c = self.prefills[i]
            if c.start == 0 and (window is None or window >= c.ctx):
                self.masks[key] = None
            else:
                q = torch.arange(c.start, c.ctx, device=self.slot_mapping.device)[:, None]
                k = torch.arange(c.ctx, device=q.device)[None, :]
                mask = k <= q
                if window is not None:
                    mask &= k > q - window
                self.masks[key] = mask
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
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, d]
    cache.key_slots[layer].index_copy_(0, meta.slot_mapping, k_new.to(cache.spec.dtype))
    cache.value_slots[layer].index_copy_(0, meta.slot_mapping, v_new.to(cache.spec.dtype))
    k_rows, v_rows = cache.key_rows[layer], cache.value_rows[layer]  # [num_slots * kv_heads, d]

    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    out = query.new_empty(num_tokens, num_heads, head_dim)

    queries = query[0].transpose(0, 1)  # [T, heads, d]
    for g, group in enumerate(meta.decodes):
        q = queries[group.rows]  # [n, heads, d]
        num_dec = q.shape[0]
        # Head h uses kv head h // groups, so groups fold into the query-length axis: no repeat.
        q = q.reshape(num_dec, num_kv_heads, groups, head_dim).to(k_rows.dtype)
        shape = (num_dec, num_kv_heads, group.max_len, head_dim)
        k = k_rows.index_select(0, group.gather).view(shape)
        v = v_rows.index_select(0, group.gather).view(shape)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=meta.decode_mask(g, window), scale=scaling
        )
        out[group.rows] = o.reshape(num_dec, num_heads, head_dim).to(out.dtype)

    for i, c in enumerate(meta.prefills):
        q = query[:, :, c.q_start : c.q_end]  # [1, heads, n, d]
        if c.gather is None:  # start == 0: the context is exactly this chunk's fresh K/V
            k, v = key[:, :, c.q_start : c.q_end], value[:, :, c.q_start : c.q_end]
        else:
            shape = (1, num_kv_heads, c.ctx, head_dim)
            k = k_rows.index_select(0, c.gather).view(shape)
            v = v_rows.index_select(0, c.gather).view(shape)
        mask = meta.prefill_mask(i, window)
        o = F.scaled_dot_product_attention(
            q.to(k.dtype),
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=groups > 1,
        )
        out[c.q_start : c.q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out.unsqueeze(0), None


def register() -> None:
    """Make ``attn_implementation="jitney_paged"`` known to transformers (idempotent).

    NOTE: deliberately no ``AttentionMaskInterface`` entry. For an implementation absent from the
    mask registry, transformers (>= 4.53, checked in 5.24) returns ``attention_mask=None`` straight
    away; registering even a ``lambda: None`` makes it first scan position_ids for packed sequences
    and compose mask functions on every forward (measured 274 us vs 14 us per mask, i.e. ~7% of a
    32-sequence decode step on the tiny model). ``test_model_builds_no_mask_for_the_packed_row``
    guards it.
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
