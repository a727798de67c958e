"""Where a model's layers come from: the model code names weights, a source builds the layers.

`LlamaForward` asks for "the fused projection of these matrices" or "this norm's vector" by
transformers' names; the source decides what a layer keeps. `StateDictWeights` wraps a loaded
transformers model's tensors (dense, in its dtype). `GGUFWeights` reads a GGUF file's blocks and
keeps them quantized where a kernel covers the type (engine/layers/quantized.py), or dequantizes
them to a dense dtype. `Int8Weights` turns any dense source's matrices into Q8_0 blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from engine.heap import return_freed_heap
from engine.kernels import BlockWeights
from engine.layers.dense import DenseEmbedding, DenseLinear
from engine.layers.quantized import (
    FLOAT_KINDS,
    QuantizedEmbedding,
    QuantizedLinear,
    fused_bias,
    quantized_embedding,
    quantized_linear,
)
from engine.models.gguf_weights import GGUFTensor


class WeightSource(Protocol):
    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (and the dense tensors')."""
        ...

    def has(self, name: str) -> bool: ...

    def vector(self, name: str) -> torch.Tensor:
        """A norm's weight or another small tensor, dense in `dtype`."""
        ...

    def optional_vector(self, name: str) -> torch.Tensor | None: ...

    def linear(self, prefixes: Sequence[str]) -> nn.Module:
        """One projection computing `<prefix>.weight` (+ `<prefix>.bias` where present) of each
        prefix side by side, in order."""
        ...

    def embedding(self, prefix: str) -> nn.Module:
        """Token ids -> rows of `<prefix>.weight`."""
        ...


class StateDictWeights:
    """A transformers model's own tensors (a state dict), used as they are. With `share`, the
    tensors are the model's parameters, and each part of a fused projection is rebound to its
    rows of the fused tensor: the two models then hold one copy of the weights."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], share: bool = False):
        self.tensors = tensors
        self.share = share
        embed = tensors.get("model.embed_tokens.weight")
        self._dtype = torch.float32 if embed is None else embed.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def has(self, name: str) -> bool:
        return name in self.tensors

    def vector(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def optional_vector(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def linear(self, prefixes: Sequence[str]) -> nn.Module:
        names = [f"{p}.weight" for p in prefixes]
        bias_names = [f"{p}.bias" for p in prefixes]
        layer = DenseLinear.fuse(
            [self.tensors[n] for n in names], [self.tensors.get(n) for n in bias_names]
        )
        if self.share and len(prefixes) > 1:
            self._rebind(names, layer.weight)
            if layer.bias is not None:
                self._rebind(bias_names, layer.bias)
        return layer

    def _rebind(self, names: Sequence[str], fused: torch.Tensor) -> None:
        """Each part's parameter becomes a view of its rows of `fused` (same values)."""
        at = 0
        for name in names:
            part = self.tensors[name]
            rows = part.shape[0]
            part.data = fused.data[at : at + rows]
            at += rows

    def embedding(self, prefix: str) -> nn.Module:
        return DenseEmbedding(self.tensors[f"{prefix}.weight"])


TRIM_BYTES = 8 << 20  # file bytes packed between two trims of the heap


class GGUFWeights:
    """A GGUF file's tensors (engine/models/gguf_weights.py). With `quantized`, each projection
    and the embedding keep the file's blocks where a kernel covers their type
    (engine/layers/quantized.py) and everything else is dequantized to `dtype`, matrix by matrix
    (`dense_fallbacks` names the quantized ones no kernel covers); without it, every tensor is
    dequantized (the reference the quantized path is measured against)."""

    def __init__(self, tensors: Mapping[str, GGUFTensor], dtype: torch.dtype, quantized: bool):
        self.tensors = tensors
        self._dtype = dtype
        self.quantized = quantized
        # Packed tables by prefix: a tied LM head multiplies by the embedding's own blocks.
        self._tables: dict[str, QuantizedEmbedding] = {}
        # Quantized matrices of a type no kernel covers, by name -> type: dequantized alone.
        self.dense_fallbacks: dict[str, str] = {}
        self._untrimmed = 0  # file bytes packed since the heap was last trimmed

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def has(self, name: str) -> bool:
        return name in self.tensors

    def vector(self, name: str) -> torch.Tensor:
        return self.tensors[name].dequantize().to(self._dtype)

    def optional_vector(self, name: str) -> torch.Tensor | None:
        return self.vector(name) if name in self.tensors else None

    def linear(self, prefixes: Sequence[str]) -> nn.Module:
        if len(prefixes) == 1 and (table := self._tables.get(prefixes[0])) is not None:
            return QuantizedLinear([table.weights], None)
        parts = [self.tensors[f"{p}.weight"] for p in prefixes]
        biases = [self.optional_vector(f"{p}.bias") for p in prefixes]
        layer = quantized_linear(parts, biases) if self.quantized else None
        if layer is None:
            if self.quantized:
                self._note_dense(parts)
            layer = DenseLinear.fuse([self._dense(t) for t in parts], biases)
        for t in parts:
            t.release()
        # Packing's temporaries back to the system, not kept to the end (engine/heap.py); a
        # trim after every small projection would hand back pages the next one faults in again.
        self._untrimmed += sum(t.raw.nbytes for t in parts)
        if self._untrimmed >= TRIM_BYTES:
            return_freed_heap()
            self._untrimmed = 0
        return layer

    def embedding(self, prefix: str) -> nn.Module:
        table = self.tensors[f"{prefix}.weight"]
        layer = quantized_embedding(table) if self.quantized else None
        if layer is not None:
            self._tables[prefix] = layer
        else:
            if self.quantized:
                self._note_dense([table])
            layer = DenseEmbedding(self._dense(table))
        table.release()
        return_freed_heap()
        return layer

    def _note_dense(self, tensors: Sequence[GGUFTensor]) -> None:
        for t in tensors:
            if t.kind not in FLOAT_KINDS:
                self.dense_fallbacks[t.name] = t.kind

    def _dense(self, tensor: GGUFTensor) -> torch.Tensor:
        return tensor.dequantize().to(self._dtype)


class Int8Weights:
    """Any dense source's projections and embedding table as Q8_0 blocks made at load
    (`BlockWeights.quantize_q8_0`: int8 per weight, one f16 scale per 32), multiplied through the
    CPU kernels; vectors (norms, biases) stay as they are. A tied LM head shares the table's
    blocks, so the weights are held once, in about 1.1 bytes each."""

    def __init__(self, dense: WeightSource):
        self.dense = dense
        self._tables: dict[str, QuantizedEmbedding] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.dense.dtype

    def has(self, name: str) -> bool:
        return self.dense.has(name)

    def vector(self, name: str) -> torch.Tensor:
        return self.dense.vector(name)

    def optional_vector(self, name: str) -> torch.Tensor | None:
        return self.dense.optional_vector(name)

    def linear(self, prefixes: Sequence[str]) -> nn.Module:
        if len(prefixes) == 1 and (table := self._tables.get(prefixes[0])) is not None:
            return QuantizedLinear([table.weights], None)
        parts = [self.dense.vector(f"{p}.weight") for p in prefixes]
        biases = [self.dense.optional_vector(f"{p}.bias") for p in prefixes]
        weights = BlockWeights.quantize_q8_0(torch.cat(parts))
        return QuantizedLinear([weights], fused_bias(biases))

    def embedding(self, prefix: str) -> nn.Module:
        weights = BlockWeights.quantize_q8_0(self.dense.vector(f"{prefix}.weight"))
        layer = QuantizedEmbedding(weights)
        self._tables[prefix] = layer
        return layer
