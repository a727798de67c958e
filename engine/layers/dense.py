"""Dense layers: weights kept as plain tensors in the model's dtype.

A model asks a projection to multiply (`layer(x)`) and an embedding to look up (`embed(ids)`) and
never looks at the weights; which kernel runs and how the weights are packed is the layer's own
business (engine/layers/quantized.py keeps them in fewer bits behind the same calls). Fused
projections (QKV, gate/up) are one layer whose output the model splits: `fuse` concatenates the
parts' rows once, at load.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class DenseLinear(nn.Module):
    """y = x @ W.T (+ b), W [out, in] in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def fuse(
        cls, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None = None
    ) -> DenseLinear:
        """One layer computing every part's output side by side, in order (rows concatenated).
        Biases: all or none (a part without one would need zeros, which is what a fused
        QKV without biases does not pay for)."""
        bias = None
        if biases is not None and any(b is not None for b in biases):
            if any(b is None for b in biases):
                raise ValueError("a fused projection needs a bias on every part or on none")
            bias = _cat(biases)  # type: ignore[arg-type]
        return cls(_cat(weights), bias)


class DenseEmbedding(nn.Module):
    """Token ids -> rows of the table [vocab, hidden]."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One part is kept as it is (a tied LM head shares the embedding's table)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))
