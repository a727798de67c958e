"""The jitney:: ops in pure torch: dequantize to float32, then F.linear / indexing.

The fallback where the C++ kernels cannot be built, and the definition of what they compute. The
packed layout is engine/kernels/csrc/quant_linear.cpp's (qs per row, d and m float32 [N, K/32]).
Dequantizing is bit-exact with gguf's `dequantize`: d*q is exact in float32 and `+ m` rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block, along the input dimension


def q4_1_dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 nibbles + d, m [N, K/32] -> float32 [N, K]."""
    n, nb = d.shape
    nibbles = qs.view(n, nb, BLOCK // 2)
    # ggml's order: byte j of a block holds element j (low nibble) and element j + 16 (high).
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.float32)
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).view(n, nb * BLOCK)


def q8_0_dequantize(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 + d [N, K/32] -> float32 [N, K]."""
    n, nb = d.shape
    return (qs.view(n, nb, BLOCK).to(torch.float32) * d.unsqueeze(-1)).view(n, nb * BLOCK)


def q4_1_linear(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, panel_min_tokens: int
) -> torch.Tensor:
    return F.linear(x, q4_1_dequantize(qs, d, m))


def q8_0_linear(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, panel_min_tokens: int
) -> torch.Tensor:
    return F.linear(x, q8_0_dequantize(qs, d))


def q8_0_embedding(ids: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).long()
    return q8_0_dequantize(qs[flat], d[flat]).view(*ids.shape, qs.shape[1])
