"""Embeddings: a prompt's final hidden states pooled into one vector (vLLM's "embed" pooling).

A pooling request is a prefill-only request: it is scheduled, chunked, preempted and batched
as any other (max_tokens 1, so its KV is its prompt's), and the step that computes its prompt's
last token ends it with a vector instead of a token. Per step, `Pooler.rows` names the rows of
each pooling chunk whose hidden states (after the model's final norm) the forward must return,
and `Pooler.absorb` takes them:
- "last": the prompt's last token, the only one that has attended to the whole input in a
  causal decoder (vLLM's default for decoder models); it may come from the prefix cache's
  blocks like any prompt, since the last token is always computed;
- "mean": the mean over every prompt token, summed in float32 chunk by chunk. Each token must
  be computed here, so a mean-pooling request skips the prefix cache (its blocks still serve
  others); after a preemption the recomputed positions are not summed twice.
The vector is raw (not normalised): the caller normalises (`normalize`), or truncates first
(Matryoshka dimensions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine.config import POOLING_METHODS
from scheduler import Sequence, StepPlan


@dataclass(slots=True)
class _Pooling:
    """One pooling sequence's progress."""

    seq: Sequence
    num_pooled: int = 0  # prompt positions [0, num_pooled) are in `total`
    total: torch.Tensor | None = None  # float32 [hidden]: the sum ("mean"), or the last row


@dataclass(slots=True)
class Pooler:
    method: str = "last"
    by_seq: dict[str, _Pooling] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {POOLING_METHODS}, got {self.method!r}")

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.by_seq

    def add(self, seq: Sequence) -> None:
        """Pool `seq` (not yet scheduled). Mean pooling computes every prompt position."""
        seq.speculation.enabled = False  # it never decodes
        if self.method == "mean":
            seq.uses_prefix_cache = False
        self.by_seq[seq.seq_id] = _Pooling(seq)

    def rows(self, plan: StepPlan) -> dict[str, tuple[int, int]]:
        """Sequence id -> (first, count): the rows of its chunk whose hidden states this step
        must return (the chunk's own rows, 0 = its first token)."""
        wanted: dict[str, tuple[int, int]] = {}
        if not self.by_seq:
            return wanted
        for chunk in plan.chunks:
            pooling = self.by_seq.get(chunk.seq_id)
            if pooling is None or not chunk.is_prefill:
                continue
            if self.method == "last":
                if chunk.samples:  # the chunk ends at the prompt's last token
                    wanted[chunk.seq_id] = (chunk.num_tokens - 1, 1)
                continue
            # Chunks run in order from position 0 (no prefix cache): a gap would be a bug.
            assert chunk.start <= pooling.num_pooled, (chunk.seq_id, chunk.start)
            first = pooling.num_pooled - chunk.start  # > 0 in a recompute: summed already
            if first < chunk.num_tokens:
                wanted[chunk.seq_id] = (first, chunk.num_tokens - first)
        return wanted

    def absorb(
        self, plan: StepPlan, rows: Mapping[str, tuple[int, int]], hidden: torch.Tensor
    ) -> None:
        """Take this step's hidden states: `hidden` [sum of counts, hidden] holds the `rows`
        of each chunk, in chunk order."""
        at = 0
        for chunk in plan.chunks:
            span = rows.get(chunk.seq_id)
            if span is None:
                continue
            first, count = span
            part = hidden[at : at + count].float()
            at += count
            pooling = self.by_seq[chunk.seq_id]
            if self.method == "last":
                pooling.total = part[-1]
            else:
                summed = part.sum(dim=0)
                pooling.total = summed if pooling.total is None else pooling.total + summed
            pooling.num_pooled = chunk.start + first + count

    def take(self, seq_id: str) -> torch.Tensor | None:
        """A finished sequence's vector (float32 [hidden], on the host), forgotten here; None
        if its prompt was not all pooled (it ended otherwise: aborted)."""
        pooling = self.by_seq.pop(seq_id, None)
        if pooling is None or pooling.total is None:
            return None
        if pooling.num_pooled < pooling.seq.num_prompt_tokens:
            return None
        total = pooling.total
        if self.method == "mean":
            total = total / pooling.seq.num_prompt_tokens
        return total.cpu()

    def discard(self, seq_id: str) -> None:
        self.by_seq.pop(seq_id, None)

    def clear(self) -> None:
        self.by_seq.clear()


def normalize(vector: torch.Tensor) -> torch.Tensor:
    """L2-normalised (a zero vector stays zero), in float32."""
    return torch.nn.functional.normalize(vector.float(), dim=-1)
