"""Turns a StepPlan into one forward pass: packed input ids, attention metadata, logits."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.input_batch import InputBatch
from engine.kv_cache import PagedKVCache
from engine.paged_attention import AttentionMetadata, model_forward, use_paged_attention
from scheduler import Sequence, StepPlan


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        # Block tables and the upload buffer persist across steps (engine/input_batch.py).
        self.batch = InputBatch(self.device)
        use_paged_attention(model)

    # The engine calls prepare then forward, timing each as a phase (engine/step_timing.py).
    def prepare(
        self,
        plan: StepPlan,
        seqs: Mapping[str, Sequence],
        block_ids: Callable[[str], list[int]],
    ) -> AttentionMetadata:
        """The packed inputs of every chunk of `plan`, on the device, for `forward`.
        `block_ids(seq_id)` is the sequence's live block list: the same object for as long as
        its allocation lives (see InputBatch.row)."""
        input_ids: list[int] = []
        layout: list[tuple[int, int, list[int]]] = []
        for chunk in plan.chunks:
            seq = seqs[chunk.seq_id]
            if chunk.is_prefill:
                input_ids += seq.token_ids(chunk.start, chunk.start + chunk.num_tokens)
            else:  # a decode feeds back the token sampled last
                input_ids.append(seq.output_token_ids[-1])
            layout.append((chunk.start, chunk.num_tokens, block_ids(chunk.seq_id)))
        return AttentionMetadata.build(
            layout,
            self.kv_cache,
            sample=[c.samples for c in plan.chunks],
            batch=self.batch,
            keys=[c.seq_id for c in plan.chunks],
            input_ids=input_ids,
        )

    def forward(self, metadata: AttentionMetadata) -> torch.Tensor:
        """One pass over the prepared chunks: float32 logits [S, vocab], one row per chunk that
        samples, in chunk order. On CUDA it returns before the kernels finish."""
        logits = model_forward(self.model, metadata.input_ids, None, metadata, self.kv_cache)
        return logits.float()
