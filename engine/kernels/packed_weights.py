"""Weight matrices kept in GGUF's own 4- and 8-bit blocks, repacked once at load for the kernels.

A GGUF row of K weights is K/32 blocks, each with an f16 scale d (and, for Q4_1, an f16 minimum
m). The kernels read sixteen rows at a time, one row per vector lane, so packing regroups the
blocks: a *record* holds one block of sixteen consecutive rows, element-major (each element's
sixteen rows side by side), followed by the sixteen rows' scales (engine/kernels/csrc/blocks.h
documents the byte layout). A matrix is one uint8 tensor [G, K/32, record bytes], G = ceil(N/16),
read front to back as one stream; rows past N (padding to whole groups) are zero.

Nothing is rounded: the quants are the file's and the scales its f16 values, so resident bytes per
weight are the file's own (Q4_1 0.625, Q8_0 1.0625), and dequantizing is bit-exact with gguf's.
Row operations (the loader's Q/K un-permutation, fused QKV and gate/up) unpack to rows and repack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Self

import numpy as np
import torch

from engine.kernels import ops, reference
from engine.kernels.reference import BLOCK, GROUP, RowBlocks

Q4_0_BLOCK_BYTES = 18  # in the GGUF file: f16 d, 16 bytes of nibbles
Q4_1_BLOCK_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34  # f16 d, 32 int8


class _PackedMatrix:
    """What both formats share: `blocks` [G, K/32, record bytes] and the true row count."""

    __slots__ = ()  # the dataclasses below keep theirs
    kind: ClassVar[str]
    blocks: torch.Tensor
    rows: int
    batched_min_tokens: int

    def __post_init__(self) -> None:
        # Whatever packs a matrix resolves the kernels (building them once), so a forward never
        # does; later calls are a cache hit.
        ops.kernel_backend()
        record = reference.RECORD_BYTES[self.kind]
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 3 or b.shape[2] != record or not b.is_contiguous():
            got = f"{b.dtype} {tuple(b.shape)}"
            raise TypeError(
                f"{self.kind}: blocks must be contiguous uint8 [G, K/32, {record}], got {got}"
            )
        if not (b.shape[0] - 1) * GROUP < self.rows <= b.shape[0] * GROUP:
            raise ValueError(f"{self.kind}: {self.rows} rows do not fill {b.shape[0]} groups of 16")

    @property
    def out_features(self) -> int:
        return self.rows

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] * BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed matrix."""
        return self.blocks.numel()

    def row_blocks(self) -> RowBlocks:
        """The matrix as rows again: quants [N, K] and scales [N, K/32] as in the file."""
        return reference.unpack(self.blocks, self.kind, self.rows)

    @classmethod
    def from_row_blocks(cls, rb: RowBlocks, batched_min_tokens: int = 0) -> Self:
        """Packed from rows; `batched_min_tokens` 0: the kernels' measured crossover."""
        return cls(reference.pack(rb, cls.kind), rb.q.shape[0], batched_min_tokens)

    def permute_rows(self, perm: torch.Tensor) -> Self:
        """The same matrix with row i taken from row perm[i] (whole blocks move, nothing is
        dequantized)."""
        perm = torch.as_tensor(perm, dtype=torch.long)
        if perm.shape != (self.out_features,):
            raise ValueError(f"perm must have {self.out_features} entries, got {tuple(perm.shape)}")
        rb = self.row_blocks()
        taken = RowBlocks(rb.q[perm], rb.d[perm], None if rb.m is None else rb.m[perm])
        return self.from_row_blocks(taken, self.batched_min_tokens)

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        """One matrix whose rows are the parts' rows, in order (a fused projection)."""
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("cat needs at least one matrix, all with the same in_features")
        if len(parts) == 1:
            return parts[0]
        rbs = [p.row_blocks() for p in parts]
        m = None if rbs[0].m is None else torch.cat([rb.m for rb in rbs])  # type: ignore[misc]
        joined = RowBlocks(torch.cat([rb.q for rb in rbs]), torch.cat([rb.d for rb in rbs]), m)
        return cls.from_row_blocks(joined, parts[0].batched_min_tokens)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], equal bit for bit to gguf.quants.dequantize."""
        return reference.dequantize(self.blocks, self.kind, self.rows)

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
        return torch.ops.jitney.quant_linear(
            x, self.blocks, reference.MATRIX_KINDS.index(self.kind), self.rows,
            self.batched_min_tokens,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Q4_1Weights(_PackedMatrix):
    """W[n, 32b + j] = d[n, b] * q + m[n, b], q the 4-bit quant of element j of block b (0..15)."""

    kind: ClassVar[str] = "Q4_1"
    blocks: torch.Tensor  # uint8 [G, K/32, 320]
    rows: int
    batched_min_tokens: int = 0

    @classmethod
    def from_gguf_blocks(cls, blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Self:
        """`blocks`: the tensor's raw bytes, [N, K/32 * 20] uint8 (gguf's `ReaderTensor.data`);
        `shape`: (N, K), out x in."""
        raw = _raw_blocks(blocks, shape, Q4_1_BLOCK_BYTES, "Q4_1")
        n, k = shape
        nibbles = raw[..., 4:]  # byte j: element j (low nibble), element j + 16 (high)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k)
        d, m = _f16(raw[..., 0:2]), _f16(raw[..., 2:4])
        return cls.from_row_blocks(RowBlocks(q, d, m))

    @classmethod
    def from_gguf_q4_0_blocks(
        cls, blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]
    ) -> Self:
        """Q4_0 blocks (w = d * (q - 8)) as Q4_1 with m = -8 d: exact, since multiplying an f16
        by 8 only moves its exponent (d is at most 8192 for it to stay finite, which gguf's
        quantizer never comes near)."""
        raw = _raw_blocks(blocks, shape, Q4_0_BLOCK_BYTES, "Q4_0")
        n, k = shape
        nibbles = raw[..., 2:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k)
        d = _f16(raw[..., 0:2])
        m = (d.float() * -8).to(torch.float16)
        if not torch.equal(m.float(), d.float() * -8):
            raise ValueError("Q4_0: a block scale too large to move into Q4_1's minimum")
        return cls.from_row_blocks(RowBlocks(q, d, m))


@dataclass(frozen=True, slots=True)
class Q8_0Weights(_PackedMatrix):
    """W[n, 32b + j] = d[n, b] * q, q the int8 of element j of block b; also an embedding table."""

    kind: ClassVar[str] = "Q8_0"
    blocks: torch.Tensor  # uint8 [G, K/32, 544]
    rows: int
    batched_min_tokens: int = 0

    @classmethod
    def from_gguf_blocks(cls, blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Self:
        """`blocks`: [N, K/32 * 34] uint8; `shape`: (N, K)."""
        raw = _raw_blocks(blocks, shape, Q8_0_BLOCK_BYTES, "Q8_0")
        n, k = shape
        q = raw[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return cls.from_row_blocks(RowBlocks(q, _f16(raw[..., 0:2]), None))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Self:
        """Q8_0 blocks of a dense [N, K] matrix (K a multiple of 32), as gguf makes them: per
        block of 32, d = max |w| / 127 in f16 and q = round(w / d)."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"Q8_0 needs K a multiple of {BLOCK}, got {k}")
        blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
        d = (blocks.abs().amax(-1) / 127).to(torch.float16)
        d32 = d.float()
        inv = torch.where(d32 > 0, 1 / d32, torch.zeros_like(d32))
        q = (blocks * inv.unsqueeze(-1)).round().clamp_(-127, 127).to(torch.int8)
        return cls.from_row_blocks(RowBlocks(q.reshape(n, k), d, None))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, int64/int32) of the dequantized table: float32 [*ids.shape, K]."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"Q8_0Weights.embedding needs int64 or int32 ids, got {ids.dtype}")
        return torch.ops.jitney.q8_0_embedding(ids, self.blocks, self.rows)


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


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[N, NB, 2] bytes of little-endian f16 -> float16 [N, NB]."""
    return raw.contiguous().view(torch.float16).squeeze(-1)
