"""How the runner calls a model: one packed step on the paged KV cache, logits out.

`ModelForward` is the whole interface: the step's token ids and positions [T], the step's
`AttentionMetadata` and the `PagedKVCache` it writes and reads. Every implementation writes the
same pool and reads the same step inputs, so attention, KV sizing, CUDA graphs and the parity
tests serve them all. Today's is `TransformersForward`: a stock transformers decoder with its
attention switched to Jitney's (engine/attention/paged_attention.py); the runner picks it in
`engine.runner.model_runner.model_forward_for`.

Pooling (embeddings, engine/pooling.py) needs more than logits: `with_hidden` runs the same
step and also returns the final-norm hidden states of the rows it names.
"""

from __future__ import annotations

import inspect
from typing import Protocol

import torch

from engine.attention.paged_attention import use_paged_attention
from engine.attention.step_inputs import AttentionMetadata
from engine.kv_cache import PagedKVCache


class ModelForward(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """``input_ids``/``positions`` [T] (or [1, T]; positions None = the metadata's).
        Returns logits ``[S, vocab]`` for ``metadata.logits_indices`` only (on CUDA, possibly
        before the kernels finish)."""
        ...

    def with_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
        hidden_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits as the call returns them, and the hidden states after the model's final
        norm ``[H, hidden]`` of rows ``hidden_rows`` [H] of T (what a pooling request needs)."""
        ...


class TransformersForward:
    """A transformers causal LM on the paged attention (switched over once, here)."""

    def __init__(self, model: torch.nn.Module):
        use_paged_attention(model)
        self.model = model

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        return model_forward(self.model, input_ids, positions, metadata, kv_cache)

    def with_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
        hidden_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's own output is the final-norm hidden states of every row (the causal
        LM then slices the rows it wants logits of): kept by a hook for this call only, so
        the logits are computed exactly as in a plain step, whatever the model's head does."""
        kept: list[torch.Tensor] = []

        def keep(module: torch.nn.Module, args: object, output: object) -> None:
            kept.append(output[0])  # type: ignore[index]  # last_hidden_state [1, T, hidden]

        handle = self.model.get_decoder().register_forward_hook(keep)
        try:
            logits = model_forward(self.model, input_ids, positions, metadata, kv_cache)
        finally:
            handle.remove()
        with torch.inference_mode():
            return logits, kept[0][0, hidden_rows]


_LOGITS_TO_KEEP: dict[type, bool] = {}


def model_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor | None,
    metadata: AttentionMetadata,
    kv_cache: PagedKVCache,
) -> torch.Tensor:
    """One packed step of a transformers model already on the paged attention: ``input_ids``/
    ``positions`` are [T] (or [1, T]; positions None = the metadata's). Returns logits
    ``[S, vocab]`` for ``metadata.logits_indices`` only."""
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
