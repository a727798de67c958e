"""Layers that keep a GGUF file's quantized blocks and multiply through Jitney's CPU kernels.

`quantized_linear(parts, biases)` / `quantized_embedding(table)` return a layer for the block types
a kernel covers, or None (the caller then dequantizes to a dense layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.models.gguf_weights import GGUFTensor


def quantized_linear(
    parts: Sequence[GGUFTensor], biases: Sequence[torch.Tensor | None]
) -> nn.Module | None:
    return None


def quantized_embedding(table: GGUFTensor) -> nn.Module | None:
    return None
