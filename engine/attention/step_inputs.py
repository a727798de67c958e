"""A step's attention inputs: every index tensor the layers share, built once per step.

`AttentionMetadata.build` takes the step's sequences in packing order, each as (start position,
new tokens, block table), and makes, in one Python pass and then numpy over [B] / [T]:
- each token's position and KV slot (`slot_mapping`), from the persistent block table of an
  `InputBatch` (engine/runner/input_batch.py) uploaded with the rest in one copy;
- the rows whose logits are wanted (the last token of each sequence that samples, then any
  prompt rows asked for);
- the decodes (one new token each) in groups of similar context length, and the prefill chunks;
- the additive masks of the full-attention window (other windows: on first use, by layer 0).
The attention op that reads them is engine/attention/paged_attention.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from engine.kv_cache import PagedKVCache
from engine.runner.input_batch import InputBatch

if TYPE_CHECKING:  # a field's type only: the attention never looks inside
    from engine.lora.step_rows import StepAdapters

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


class _Packed(NamedTuple):
    """The step's sequences on the host, in packing order (numpy arrays over [B])."""

    starts: list[int]
    lens: list[int]
    rows: list[int]  # each sequence's row of the InputBatch block table
    start_a: np.ndarray
    len_a: np.ndarray
    row_a: np.ndarray
    cu: np.ndarray  # [B + 1]: query rows of sequence i are [cu[i], cu[i + 1])


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: slot where token t's K/V is written
    positions: torch.Tensor  # [T] int64: absolute position of token t
    logits_indices: torch.Tensor  # [S] int64: rows of T whose logits are wanted
    input_ids: torch.Tensor | None  # [T] int64, when build was given them
    block_size: int
    mask_dtype: torch.dtype  # attention's dtype: queries, keys and masks are all cast to it
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
    # The step's rows grouped by LoRA adapter (engine/lora/step_rows.py); None: the base model's.
    adapters: StepAdapters | None = None

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
        if sample is not None and len(sample) != len(seqs):
            raise ValueError(f"sample has {len(sample)} flags for {len(seqs)} sequences")
        batch = InputBatch(kv_cache.device) if batch is None else batch
        batch.begin_step()
        packed = _pack(seqs, batch, keys, bs)
        positions, token_rows = _token_rows(packed)
        logits_idx = _logits_rows(packed.cu, sample, prompt_rows)
        groups = _decode_groups(packed, kv_cache.decode_kernel)
        members = np.concatenate(groups) if groups else np.flatnonzero(packed.len_a == 1)
        ids_t, pos_t, token_rows_t, logits_t, dec_rows_t, dec_ctx_t, dec_q_t = batch.upload(
            input_ids or [],
            positions,
            token_rows,
            logits_idx,
            packed.row_a[members],
            packed.start_a[members] + 1,
            packed.cu[members],
        )
        table = batch.block_table
        meta = cls(
            slot_mapping=table[token_rows_t, pos_t // bs] * bs + pos_t % bs,
            positions=pos_t,
            logits_indices=logits_t,
            input_ids=ids_t if input_ids else None,
            block_size=bs,
            mask_dtype=kv_cache.spec.attention_dtype,
            decodes=_decode_views(groups, packed, table, dec_rows_t, dec_q_t, bs),
            decode_ctx=dec_ctx_t,
            prefills=_prefill_views(packed, table, bs),
            table_rows=token_rows_t,
        )
        for g in range(0 if kv_cache.decode_kernel else len(meta.decodes)):
            meta.decode_mask(g, None)
        for i in range(len(meta.prefills)):
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


def _pack(
    seqs: Sequence[tuple[int, int, Sequence[int]]],
    batch: InputBatch,
    keys: Sequence[Hashable] | None,
    block_size: int,
) -> _Packed:
    """The one pass per sequence in Python: checked, and given its block-table row."""
    starts, lens, rows = [], [], []
    for i, (start, n, table) in enumerate(seqs):
        if n < 1 or start < 0 or len(table) * block_size < start + n:
            raise ValueError(
                f"sequence {i}: start {start}, {n} new tokens, {len(table)} blocks of "
                f"{block_size} do not fit"
            )
        starts.append(start)
        lens.append(n)
        rows.append(batch.row(i if keys is None else keys[i], table))
    len_a = np.array(lens)
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(len_a, out=cu[1:])
    return _Packed(starts, lens, rows, np.array(starts), len_a, np.array(rows), cu)


def _token_rows(packed: _Packed) -> tuple[np.ndarray, np.ndarray]:
    """[T] each token's position, and its sequence's block-table row."""
    cu = packed.cu
    num_seqs = len(packed.starts)
    if cu[-1] == num_seqs:  # one token each (all decodes)
        return packed.start_a, packed.row_a
    seq_of_token = np.repeat(np.arange(num_seqs), packed.len_a)
    positions = packed.start_a[seq_of_token] + np.arange(cu[-1]) - cu[seq_of_token]
    return positions, packed.row_a[seq_of_token]


def _logits_rows(
    cu: np.ndarray, sample: Sequence[bool] | None, prompt_rows: Sequence[tuple[int, int]]
) -> np.ndarray:
    """[S] the rows of T whose logits are wanted: the last token of each sequence that samples,
    then the first k tokens of each (sequence, k) in `prompt_rows`."""
    logits_idx = cu[1:] - 1
    if sample is not None:
        logits_idx = logits_idx[np.asarray(sample, dtype=bool)]
    if prompt_rows:
        wanted = [cu[i] + np.arange(k) for i, k in prompt_rows]
        logits_idx = np.concatenate([logits_idx, *wanted])
    return logits_idx


def _decode_groups(packed: _Packed, decode_kernel: bool) -> list[np.ndarray]:
    """The decodes (sequence indices) in groups, members in packing order within a group, so an
    all-decode group is a slice of rows. The in-place kernel reads each row's own context,
    whatever the others': one group."""
    decodes = np.flatnonzero(packed.len_a == 1)
    if decode_kernel:
        return [decodes] if len(decodes) else []
    dec_ctx = packed.start_a[decodes] + 1
    return [decodes[sorted(g)] for g in group_decodes(dec_ctx.tolist(), DECODE_GROUP_COST_TOKENS)]


def _decode_views(
    groups: list[np.ndarray],
    packed: _Packed,
    table: torch.Tensor,
    dec_rows: torch.Tensor,  # [Bd] each member's block-table row, group after group
    dec_q: torch.Tensor,  # [Bd] each member's query row of T
    block_size: int,
) -> list[DecodeGroup]:
    dec_groups: list[DecodeGroup] = []
    at = 0
    for g in groups:
        min_len, max_len = int(packed.start_a[g].min()) + 1, int(packed.start_a[g].max()) + 1
        first, last = int(packed.cu[g[0]]), int(packed.cu[g[-1]])
        num_blocks = -(-max_len // block_size)
        m = slice(at, at + len(g))
        dec_groups.append(
            DecodeGroup(
                slice(first, last + 1) if last - first == len(g) - 1 else dec_q[m],
                table[dec_rows[m], :num_blocks].reshape(-1),
                m,
                num_blocks,
                min_len,
            )
        )
        at += len(g)
    return dec_groups


def _prefill_views(packed: _Packed, table: torch.Tensor, block_size: int) -> list[PrefillChunk]:
    """Every sequence with more than one new token; its blocks only when it starts past 0."""
    starts, lens, rows, cu = packed.starts, packed.lens, packed.rows, packed.cu
    return [
        PrefillChunk(
            int(cu[i]),
            int(cu[i + 1]),
            starts[i],
            starts[i] + lens[i],
            table[rows[i], : -(-(starts[i] + lens[i]) // block_size)] if starts[i] else None,
        )
        for i in np.flatnonzero(packed.len_a > 1).tolist()
    ]
