"""Layers that keep a GGUF file's quantized blocks and multiply through Jitney's CPU kernels.

`quantized_linear(parts, biases)` / `quantized_embedding(table)` return a layer for the block
types a kernel covers (engine/kernels: Q4_0, Q4_1 and Q8_0 blocks regrouped sixteen rows at a
time, the file's own quants and f16 scales), or None, and the caller then dequantizes to a dense
layer. A fused projection concatenates its parts'
packed rows (whole blocks), so it never dequantizes either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from engine.kernels import Q4_1Weights, Q8_0Weights
from engine.models.gguf_weights import GGUFTensor

# GGUF block type -> how its rows become a packed matrix. Q4_0 (w = d * (q - 8)) is Q4_1 with
# m = -8 d, exact in f16 (a power-of-two multiple), so it runs on the Q4_1 kernels.
_PACKERS: dict[str, Callable[[np.ndarray, tuple[int, int]], Q4_1Weights | Q8_0Weights]] = {
    "Q4_0": Q4_1Weights.from_gguf_q4_0_blocks,
    "Q4_1": Q4_1Weights.from_gguf_blocks,
    "Q8_0": Q8_0Weights.from_gguf_blocks,
}
COVERED_KINDS = tuple(_PACKERS)
_FLOAT_KINDS = ("F32", "F16", "BF16")  # dequantized to dense layers, as they are


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ b), W kept in its file's blocks; x float32."""

    def __init__(self, weights: Q4_1Weights | Q8_0Weights, bias: torch.Tensor | None):
        super().__init__()
        self.weights = weights
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * 4
        return self.weights.nbytes + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weights.linear(x)
        return y if self.bias is None else y + self.bias


class QuantizedEmbedding(nn.Module):
    """Token ids -> float32 rows of a Q8_0 table."""

    def __init__(self, weights: Q8_0Weights):
        super().__init__()
        self.weights = weights

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.embedding(ids)


def quantized_linear(
    parts: Sequence[GGUFTensor], biases: Sequence[torch.Tensor | None]
) -> QuantizedLinear | None:
    packed = [_PACKERS[p.kind](p.rows(), p.shape) for p in parts if p.kind in _PACKERS]
    formats = {type(w) for w in packed}
    if len(packed) != len(parts) or len(formats) != 1:
        return None  # a part the kernels do not cover, or parts of two formats: dense
    return QuantizedLinear(formats.pop().cat(packed), fused_bias(biases))


def uncovered_kinds(tensors: Mapping[str, GGUFTensor]) -> list[str]:
    """The quantized block types of a GGUF file's layer matrices that no kernel covers (sorted).
    The embedding table and a separate LM head may be of any type: those are dequantized."""
    kinds = {t.kind for name, t in tensors.items() if name.startswith("model.layers.")}
    return sorted(kinds - set(COVERED_KINDS) - set(_FLOAT_KINDS))


def fused_bias(biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The parts' biases side by side, as one fused projection's; None when none has one."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("a fused projection needs a bias on every part or on none")
    return torch.cat(list(biases))  # type: ignore[arg-type]


def quantized_embedding(table: GGUFTensor) -> QuantizedEmbedding | None:
    if table.kind != "Q8_0":
        return None  # the kernels look up Q8_0 rows only: other tables are dequantized
    return QuantizedEmbedding(Q8_0Weights.from_gguf_blocks(table.rows(), table.shape))
