"""Weight matrices kept in GGUF's own 4- and 8-bit blocks, packed once at load for the kernels.

A GGUF row of K weights is K/32 blocks. Packing splits the blocks into the arrays the kernels read
(engine/kernels/csrc/quant_linear.cpp): the quants as they are, and the f16 scales (and minimums)
converted exactly to float32. Rows stay whole, so permuting or concatenating rows (the loader's
Q/K un-permutation, fused QKV and gate/up) never dequantizes.

Resident bytes per weight: Q4_1 0.75 (the file's 0.625), Q8_0 1.125 (the file's 1.0625).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch

from engine.kernels import ops, reference
from engine.kernels.reference import BLOCK

Q4_1_BLOCK_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34  # f16 d, 32 int8

# NOTE: from this many tokens on, a linear dequantizes panels of rows for MKL's sgemm instead of
# running the fused kernel. Measured with `python -m bench.kernels --crossover` (Zen 3, 2 threads):
# the fused kernel wins clearly up to T=16, the two are within ~5% at T=24, panels win from T=32
# (Q8_0's 49152-row head from T=24) and by 1.4-1.7x at T=128.
Q4_1_PANEL_MIN_TOKENS = 32
Q8_0_PANEL_MIN_TOKENS = 24


class _RowBlocks:
    """What every packed format shares: `qs` and `d` (and any other tensor field) hold one row of
    the matrix per row, `d` is [N, K/32]."""

    __slots__ = ()  # the dataclasses below keep theirs
    qs: torch.Tensor
    d: torch.Tensor
    panel_min_tokens: int

    def __post_init__(self) -> None:
        # Whatever packs a matrix resolves the kernels (building them once), so a forward never
        # does; later calls are a cache hit.
        ops.kernel_backend()
        if self.d.dtype != torch.float32 or self.d.dim() != 2:
            got = f"{self.d.dtype} {tuple(self.d.shape)}"
            raise TypeError(f"{type(self).__name__}: d must be float32 [N, K/32], got {got}")

    @property
    def out_features(self) -> int:
        return self.d.shape[0]

    @property
    def in_features(self) -> int:
        return self.d.shape[1] * BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed matrix."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def permute_rows(self, perm: torch.Tensor) -> Self:
        """The same matrix with row i taken from row perm[i] (whole blocks move, nothing is
        dequantized)."""
        perm = torch.as_tensor(perm, dtype=torch.long)
        if perm.shape != (self.out_features,):
            raise ValueError(f"perm must have {self.out_features} entries, got {tuple(perm.shape)}")
        return dataclasses.replace(self, **{k: t[perm] for k, t in self._tensors().items()})

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        """One matrix whose rows are the parts' rows, in order (a fused projection)."""
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("cat needs at least one matrix, all with the same in_features")
        tensors = {k: torch.cat([p._tensors()[k] for p in parts]) for k in parts[0]._tensors()}
        return dataclasses.replace(parts[0], **tensors)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T for float32 x [..., K] -> float32 [..., N]."""
        if x.dtype != torch.float32:
            raise TypeError(f"{type(self).__name__}.linear needs float32 x, got {x.dtype}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the matrix takes {self.in_features}")
        if x.dim() == 2:  # the model's [tokens, hidden]: no reshapes on the hot path
            return self._linear_2d(x)
        y = self._linear_2d(x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if isinstance(getattr(self, f.name), torch.Tensor)
        }


@dataclass(frozen=True, slots=True)
class Q4_1Weights(_RowBlocks):
    """W[n, 32b + j] = d[n, b] * q + m[n, b], q the nibble of element j of block b (0..15)."""

    qs: torch.Tensor  # uint8 [N, K/2]: each block's 16 bytes as in the file
    d: torch.Tensor  # float32 [N, K/32]
    m: torch.Tensor  # float32 [N, K/32]
    panel_min_tokens: int = Q4_1_PANEL_MIN_TOKENS

    @classmethod
    def from_gguf_blocks(cls, blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Self:
        """`blocks`: the tensor's raw bytes, [N, K/32 * 20] uint8 (gguf's `ReaderTensor.data`);
        `shape`: (N, K), out x in."""
        raw = _raw_blocks(blocks, shape, Q4_1_BLOCK_BYTES, "Q4_1")
        n, k = shape
        return cls(
            qs=raw[..., 4:].reshape(n, k // 2).contiguous(),
            d=_f16_to_f32(raw[..., 0:2]),
            m=_f16_to_f32(raw[..., 2:4]),
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], equal bit for bit to gguf.quants.dequantize."""
        return reference.q4_1_dequantize(self.qs, self.d, self.m)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.jitney.q4_1_linear(x, self.qs, self.d, self.m, self.panel_min_tokens)


@dataclass(frozen=True, slots=True)
class Q8_0Weights(_RowBlocks):
    """W[n, 32b + j] = d[n, b] * q, q the int8 of element j of block b; also an embedding table."""

    qs: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # float32 [N, K/32]
    panel_min_tokens: int = Q8_0_PANEL_MIN_TOKENS

    @classmethod
    def from_gguf_blocks(cls, blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Self:
        """`blocks`: [N, K/32 * 34] uint8; `shape`: (N, K)."""
        raw = _raw_blocks(blocks, shape, Q8_0_BLOCK_BYTES, "Q8_0")
        n, k = shape
        return cls(
            qs=raw[..., 2:].reshape(n, k).contiguous().view(torch.int8),
            d=_f16_to_f32(raw[..., 0:2]),
        )

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Self:
        """Q8_0 blocks of a dense [N, K] matrix (K a multiple of 32), as gguf makes them: per
        block of 32, d = max |w| / 127 and q = round(w / d); d is kept in float32 here (the
        file's f16 would round it once more)."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"Q8_0 needs K a multiple of {BLOCK}, got {k}")
        blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
        d = blocks.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        qs = (blocks * inv.unsqueeze(-1)).round().clamp_(-127, 127).to(torch.int8)
        return cls(qs=qs.reshape(n, k).contiguous(), d=d.contiguous())

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], equal bit for bit to gguf.quants.dequantize."""
        return reference.q8_0_dequantize(self.qs, self.d)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, int64/int32) of the dequantized table: float32 [*ids.shape, K]."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"Q8_0Weights.embedding needs int64 or int32 ids, got {ids.dtype}")
        return torch.ops.jitney.q8_0_embedding(ids, self.qs, self.d)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.jitney.q8_0_linear(x, self.qs, self.d, self.panel_min_tokens)


def _raw_blocks(
    blocks: np.ndarray | torch.Tensor, shape: tuple[int, int], block_bytes: int, kind: str
) -> torch.Tensor:
    """The blocks as an owned uint8 tensor [N, K/32, block_bytes], after checking the shapes."""
    n, k = shape
    if k % BLOCK != 0:
        raise ValueError(f"{kind} needs in_features divisible by {BLOCK}, got {k}")
    # Copied: gguf hands out a read-only memory map, and the packed arrays must own their memory.
    raw = torch.tensor(np.asarray(blocks)) if not isinstance(blocks, torch.Tensor) else blocks
    if raw.dtype != torch.uint8:
        raise TypeError(f"{kind} blocks must be uint8 bytes, got {raw.dtype}")
    if raw.numel() != n * (k // BLOCK) * block_bytes:
        raise ValueError(
            f"{kind} {shape} needs {n * (k // BLOCK) * block_bytes} bytes of blocks, "
            f"got {tuple(raw.shape)}"
        )
    return raw.reshape(n, k // BLOCK, block_bytes)


def _f16_to_f32(raw_f16: torch.Tensor) -> torch.Tensor:
    """[N, NB, 2] bytes of little-endian f16 -> float32 [N, NB] (exact)."""
    return raw_f16.contiguous().view(torch.float16).to(torch.float32).squeeze(-1)
