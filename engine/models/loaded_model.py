"""What the engine holds of a loaded model: `LoadedModel`, the model's description (the
transformers config of its architecture, device, dtype, vocabulary, KV shape), its tokenizer and
end tokens, and its transformers model, built at load or on first use (`DenseModel`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerFast


class DenseModel:
    """A loaded model's transformers model: built at load, or on first use where nothing needs
    it to start (a GGUF on Jitney's forward keeps the file's blocks: engine/models/gguf_model.py).
    Also holds the forwards built on the model (engine/runner/model_runner.py resolve_forward),
    so engines sharing a loaded model share them."""

    def __init__(
        self, model: nn.Module | None = None, build: Callable[[], nn.Module] | None = None
    ):
        if (model is None) == (build is None):
            raise ValueError("a DenseModel is a model or the way to build one")
        self.model, self._build = model, build
        self.forwards: dict[str, Any] = {}

    def get(self) -> nn.Module:
        if self.model is None:
            assert self._build is not None
            self.model, self._build = self._build(), None
        return self.model


@dataclass(frozen=True, slots=True)
class LoadedModel:
    tokenizer: PreTrainedTokenizerFast
    name: str
    # What the model is, as the transformers config of its architecture (model_type, sizes,
    # RoPE, windows): the model's own, or for a GGUF its metadata's (engine/models/gguf_config.py).
    # Jitney's forward, KV sizing and pooling read this, never the transformers model.
    config: Any
    device: torch.device
    dtype: torch.dtype  # the activations' (and the dense weights')
    vocab_size: int  # the embedding table's rows: how wide the logits are
    max_model_len: int
    eos_token_ids: list[int]
    # What a KV cache is sized from: per token and layer, K and V of num_kv_heads × head_dim each.
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dense: DenseModel
    # The GGUF file the weights come from; `--quantization gguf` keeps its blocks
    # (engine/models/weight_sources.py).
    gguf_path: Path | None = None
    # Its header, as read when the model was opened: the forward's loader maps the tensors
    # from it rather than reading the header again (262,144 strings for Gemma's vocabulary).
    gguf_index: Any = None
    # The model's generation_config.json as written (worker.generation_defaults takes its
    # sampling keys), and for the bundled SmolLM2 its authors' values; empty for in-process
    # models and GGUF files (their metadata holds no sampling keys).
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        """The transformers model (eval mode, on `device` in `dtype`), built on first use where
        the load did not need it (a GGUF: dequantized from its converted checkpoint)."""
        return self.dense.get()

    @property
    def built_model(self) -> nn.Module | None:
        """The transformers model if it was built (None: not yet)."""
        return self.dense.model

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """K + V bytes one token takes across all layers, in the model's dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def describe_loaded(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    name: str,
    gguf_path: Path | None = None,
    generation_config: dict[str, Any] | None = None,
) -> LoadedModel:
    """The LoadedModel of a model built elsewhere (eval mode, on its device and dtype)."""
    config = model.config
    weight = model.get_input_embeddings().weight
    return LoadedModel(
        tokenizer=tokenizer,
        name=name,
        config=config,
        device=weight.device,
        dtype=model.dtype,
        vocab_size=weight.shape[0],
        max_model_len=config.max_position_embeddings,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        **kv_shape(config),
        dense=DenseModel(model),
        gguf_path=gguf_path,
        generation_config=dict(generation_config or {}),
    )


def kv_shape(config: Any) -> dict[str, int]:
    num_heads = config.num_attention_heads
    return {
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // num_heads,
    }


def _eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    # Chat models often end a turn with a token other than the tokenizer's eos; generation_config
    # lists those, so the union of both, in order and without repeats, is what stops a sequence.
    candidates = model.generation_config.eos_token_id
    if not isinstance(candidates, list):
        candidates = [candidates]
    ids: list[int] = []
    for token_id in [*candidates, tokenizer.eos_token_id]:
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids
