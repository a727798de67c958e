"""Turns a StepPlan into one forward pass: packed input ids, attention metadata, logits."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.kv_cache import PagedKVCache
from engine.paged_attention import AttentionMetadata, model_forward, use_paged_attention
from scheduler import Sequence, StepPlan


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        use_paged_attention(model)

    def execute(
        self,
        plan: StepPlan,
        seqs: Mapping[str, Sequence],
        block_table: Callable[[str], list[int]],
    ) -> torch.Tensor:
        """Compute every chunk of `plan` in one pass; return float32 logits [S, vocab], one row
        per chunk that samples, in chunk order."""
        input_ids: list[int] = []
        layout: list[tuple[int, int, list[int]]] = []
        for chunk in plan.chunks:
            seq = seqs[chunk.seq_id]
            input_ids += seq.token_ids(chunk.start, chunk.start + chunk.num_tokens)
            layout.append((chunk.start, chunk.num_tokens, block_table(chunk.seq_id)))
        metadata = AttentionMetadata.build(
            layout, self.kv_cache, sample=[c.samples for c in plan.chunks]
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        logits = model_forward(self.model, ids, None, metadata, self.kv_cache)
        return logits.float()
