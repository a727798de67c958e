"""Layers that keep a GGUF file's quantized blocks and multiply through Jitney's CPU kernels.

`quantized_linear(parts, biases)` / `quantized_embedding(table)` return a layer for the block
types a kernel covers (engine/kernels/block_types.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K, each regrouped sixteen rows at a time with the file's own levels and scales), or None, and
the caller then dequantizes that matrix to a dense layer. A fused projection keeps each part in
its own type: parts of one type are joined into one packed matrix (whole blocks), parts of
different types (Gemma's Q5_0 attn_q/attn_k beside a Q8_0 attn_v) stay side by side and one
kernel call computes them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from engine.kernels import BlockWeights, linear_parts
from engine.kernels.block_types import BLOCK_TYPES
from engine.models.gguf_index import release_pages
from engine.models.gguf_weights import GGUFTensor

COVERED_KINDS = tuple(BLOCK_TYPES)
FLOAT_KINDS = ("F32", "F16", "BF16")  # dense layers, as they are


class QuantizedLinear(nn.Module):
    """y = x @ [W_0; W_1; ...].T (+ b), each part W_i kept in its file's blocks; x float32."""

    def __init__(self, parts: Sequence[BlockWeights], bias: torch.Tensor | None):
        super().__init__()
        self.parts = _joined(parts)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * 4
        return sum(p.nbytes for p in self.parts) + bias

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(p.kind for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_parts(x, self.parts)
        return y if self.bias is None else y + self.bias


def _joined(parts: Sequence[BlockWeights]) -> tuple[BlockWeights, ...]:
    """Neighbouring parts of one type as one matrix (fewer, longer streams for the kernels)."""
    return tuple(BlockWeights.cat(run) for run in _runs_of_one_kind(parts))


class _Kinded(Protocol):
    kind: str


KindedT = TypeVar("KindedT", bound=_Kinded)


def _runs_of_one_kind(parts: Sequence[KindedT]) -> list[list[KindedT]]:
    """`parts` cut where the block type changes, in order."""
    runs: list[list[KindedT]] = []
    for p in parts:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


class QuantizedEmbedding(nn.Module):
    """Token ids -> float32 rows of a table kept in its blocks."""

    def __init__(self, weights: BlockWeights):
        super().__init__()
        self.weights = weights

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.embedding(ids)


def packed(tensor: GGUFTensor) -> BlockWeights:
    """A GGUF tensor of a covered type, packed (its rows in transformers' order); a large
    table's file pages let go slice by slice as they are packed."""
    shape: tuple[int, int] = tensor.shape  # type: ignore[assignment]
    return BlockWeights.from_gguf(tensor.kind, tensor.rows(), shape, release_pages)


def quantized_linear(
    parts: Sequence[GGUFTensor], biases: Sequence[torch.Tensor | None]
) -> QuantizedLinear | None:
    """The projection in its blocks, or None where a part is of a type no kernel covers.
    Neighbouring parts of one type are packed as one matrix from their file rows joined
    (packing each and joining the packed ones would unpack and pack them again: several
    times their bytes in temporaries, on every layer)."""
    if any(p.kind not in COVERED_KINDS for p in parts):
        return None
    runs = _runs_of_one_kind(parts)
    return QuantizedLinear([_packed_run(run) for run in runs], fused_bias(biases))


def _packed_run(run: Sequence[GGUFTensor]) -> BlockWeights:
    if len(run) == 1:
        return packed(run[0])
    rows = np.concatenate([t.rows() for t in run])
    shape = (rows.shape[0], run[0].shape[1])
    return BlockWeights.from_gguf(run[0].kind, rows, shape)


def uncovered_kinds(tensors: Mapping[str, GGUFTensor]) -> list[str]:
    """The quantized block types of a GGUF file's layer matrices that no kernel covers (sorted):
    those matrices run dequantized. The embedding table and a separate LM head may be of any
    type too."""
    kinds = {t.kind for name, t in tensors.items() if name.startswith("model.layers.")}
    return sorted(kinds - set(COVERED_KINDS) - set(FLOAT_KINDS))


def fused_bias(biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The parts' biases side by side, as one fused projection's; None when none has one."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("a fused projection needs a bias on every part or on none")
    return torch.cat(list(biases))  # type: ignore[arg-type]


def quantized_embedding(table: GGUFTensor) -> QuantizedEmbedding | None:
    """The table in its blocks, or None for a float or uncovered type (dequantized instead)."""
    if table.kind not in COVERED_KINDS:
        return None
    return QuantizedEmbedding(packed(table))
