"""Weight matrices kept in a GGUF file's own blocks, repacked once at load for the kernels.

A GGUF row of K weights is K/32 blocks (K/256 super-blocks for K-quants) of one block type;
engine/kernels/block_types.py describes each type as data and packs a matrix sixteen rows at a
time, one row per vector lane: a *record* holds one block of sixteen consecutive rows,
element-major, with their scales (engine/kernels/csrc/blocks.h documents the byte layout). A
matrix is one uint8 tensor [G, K / (32 * per_super), super-block bytes], G = ceil(N/16), read
front to back as one stream; rows past N (padding to whole groups) are zero.

Nothing is rounded: the levels are the file's and the scales its f16 values (or a K-quant's
integers and its super-block's f16 d), so resident bytes per weight are within 3% of the file's,
and dequantizing is bit-exact with gguf's. Row operations (permuting, concatenating the parts of
a fused projection of one type) unpack to rows and repack.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch

from engine.huge_pages import huge_page_empty
from engine.kernels import block_types, ops
from engine.kernels.block_types import BLOCK, GROUP, BlockType, RowFields

PACK_ROWS = 4096  # rows decoded and packed at a time (a multiple of GROUP)


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """W [rows, K] in the blocks of the GGUF type `kind` ("Q4_K", "Q8_0", ...)."""

    kind: str
    blocks: torch.Tensor  # uint8 [G, K / (32 * per_super), super-block bytes]
    rows: int
    batched_min_tokens: int = 0  # 0: the kernels' measured crossover

    def __post_init__(self) -> None:
        bt = block_types.block_type(self.kind)
        # Whatever packs a matrix resolves the kernels (building them once), so a forward never
        # does; later calls are a cache hit.
        ops.kernel_backend()
        b = self.blocks
        width = bt.super_bytes
        if b.dtype != torch.uint8 or b.dim() != 3 or b.shape[2] != width or not b.is_contiguous():
            got = f"{b.dtype} {tuple(b.shape)}"
            per = BLOCK * bt.per_super
            raise TypeError(
                f"{self.kind}: blocks must be contiguous uint8 [G, K/{per}, {width}], got {got}"
            )
        if not (b.shape[0] - 1) * GROUP < self.rows <= b.shape[0] * GROUP:
            raise ValueError(f"{self.kind}: {self.rows} rows do not fill {b.shape[0]} groups of 16")

    @property
    def block_type(self) -> BlockType:
        return block_types.block_type(self.kind)

    @property
    def code(self) -> int:
        """The kind the ops take."""
        return self.block_type.code

    @property
    def out_features(self) -> int:
        return self.rows

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] * BLOCK * self.block_type.per_super

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed matrix."""
        return self.blocks.numel()

    def fields(self) -> RowFields:
        """The matrix as rows again: levels and scales as in the file."""
        return block_types.unpack(self.blocks, self.block_type, self.rows)

    @classmethod
    def from_fields(cls, kind: str, f: RowFields, batched_min_tokens: int = 0) -> Self:
        bt = block_types.block_type(kind)
        return cls(kind, block_types.pack(f, bt), f.q.shape[0], batched_min_tokens)

    @classmethod
    def from_gguf(
        cls,
        kind: str,
        raw: np.ndarray | torch.Tensor,
        shape: tuple[int, int],
        done: Callable[[np.ndarray], None] | None = None,
    ) -> Self:
        """`raw`: the tensor's rows as the file holds them, [N, bytes per row] uint8 (gguf's
        `ReaderTensor.data`); `shape`: (N, K), out x in. `done(rows)` is told of each slice of
        rows once packed (a memory-mapped file's pages can then be let go)."""
        bt = block_types.block_type(kind)
        n, k = shape
        if k % bt.file_elements != 0:
            raise ValueError(f"{kind} needs in_features divisible by {bt.file_elements}, got {k}")
        data = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        if data.dtype != np.uint8:
            raise TypeError(f"{kind} blocks must be uint8 bytes, got {data.dtype}")
        need = n * (k // bt.file_elements) * bt.file_bytes
        if data.size != need:
            raise ValueError(
                f"{kind} {shape} needs {need} bytes of blocks, got {tuple(data.shape)}"
            )
        rows = data.reshape(n, -1)
        if n <= PACK_ROWS:
            return cls.from_fields(kind, bt.decode(rows))
        # A large table (a 262,144-row vocabulary) a slice of rows at a time: decoding and
        # regrouping make a few copies of what they hold, which for the whole table would
        # briefly take several times its bytes.
        shape3 = (-(-n // GROUP), k // (BLOCK * bt.per_super), bt.super_bytes)
        blocks = huge_page_empty(math.prod(shape3)).view(shape3)
        for start in range(0, n, PACK_ROWS):
            chunk = rows[start : start + PACK_ROWS]
            first = start // GROUP
            into = blocks[first : first + -(-chunk.shape[0] // GROUP)]
            block_types.pack(bt.decode(chunk), bt, into)  # straight into the table's rows
            if done is not None:
                done(chunk)
        return cls(kind, blocks, n)

    @classmethod
    def quantize_q8_0(cls, weight: torch.Tensor) -> Self:
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
        return cls.from_fields("Q8_0", RowFields(q.reshape(n, k), d))

    def permute_rows(self, perm: torch.Tensor) -> Self:
        """The same matrix with row i taken from row perm[i] (whole blocks move, nothing is
        dequantized)."""
        perm = torch.as_tensor(perm, dtype=torch.long)
        if perm.shape != (self.out_features,):
            raise ValueError(f"perm must have {self.out_features} entries, got {tuple(perm.shape)}")
        taken = RowFields(*(None if t is None else t[perm] for t in self.fields()))
        return self.from_fields(self.kind, taken, self.batched_min_tokens)

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        """One matrix whose rows are the parts' rows, in order (a fused projection's parts of
        one type)."""
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("cat needs at least one matrix, all with the same in_features")
        if any(p.kind != parts[0].kind for p in parts):
            raise ValueError(f"cat joins matrices of one type, got {[p.kind for p in parts]}")
        if len(parts) == 1:
            return parts[0]
        fields = [p.fields() for p in parts]
        joined = RowFields(
            *(None if f[0] is None else torch.cat(f) for f in zip(*fields, strict=True))
        )
        return cls.from_fields(parts[0].kind, joined, parts[0].batched_min_tokens)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], equal bit for bit to gguf.quants.dequantize."""
        return block_types.dequantize(self.blocks, self.block_type, self.rows)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T for float32 x [..., K] -> float32 [..., N]."""
        return linear_parts(x, (self,))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, int64/int32) of the dequantized table: float32 [*ids.shape, K]."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"embedding needs int64 or int32 ids, got {ids.dtype}")
        return torch.ops.jitney.quant_embedding(ids, self.blocks, self.code, self.rows)


def linear_parts(x: torch.Tensor, parts: Sequence[BlockWeights]) -> torch.Tensor:
    """y = x @ [W_0; W_1; ...].T: each part in its own block type, side by side in y, one op."""
    k = parts[0].in_features
    if x.dtype != torch.float32:
        raise TypeError(f"a quantized linear needs float32 x, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the matrix takes {k}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # the model's [tokens, hidden]: no reshape
    y = torch.ops.jitney.quant_linear(
        x2, [p.blocks for p in parts], [p.code for p in parts], [p.rows for p in parts],
        parts[0].batched_min_tokens,
    )  # fmt: skip
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
