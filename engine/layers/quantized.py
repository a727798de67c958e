"""Layers that keep a GGUF file's quantized blocks and multiply through Jitney's CPU kernels.

`quantized_linear(parts, biases)` / `quantized_embedding(table)` return a layer for the block types
a kernel covers (engine/kernels: Q4_1 and Q8_0, float32 activations, scales kept in float32), or
None, and the caller then dequantizes to a dense layer. A fused projection concatenates its parts'
packed rows (whole blocks), so it never dequantizes either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.kernels import Q4_1Weights, Q8_0Weights
from engine.models.gguf_weights import GGUFTensor

_PACKED = {"Q4_1": Q4_1Weights, "Q8_0": Q8_0Weights}


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
    kinds = {p.kind for p in parts}
    if len(kinds) != 1 or (packed := _PACKED.get(kinds.pop())) is None:
        return None
    weights = packed.cat([packed.from_gguf_blocks(p.rows(), p.shape) for p in parts])
    return QuantizedLinear(weights, fused_bias(biases))


def fused_bias(biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The parts' biases side by side, as one fused projection's; None when none has one."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("a fused projection needs a bias on every part or on none")
    return torch.cat(list(biases))  # type: ignore[arg-type]


def quantized_embedding(table: GGUFTensor) -> QuantizedEmbedding | None:
    if table.kind != "Q8_0":
        return None
    return QuantizedEmbedding(Q8_0Weights.from_gguf_blocks(table.rows(), table.shape))
