"""GGUF block types as data: one row of traits per type, read by the packer, the pure-torch
reference and each instruction set's kernel (engine/kernels/csrc/block_types.h holds the same
table for C++), as llama.cpp's type-traits table describes each of its types once.

Every covered type is, per row and per 32 weights (a *block*), unsigned integer *levels* u with
a scale per sub-block and maybe a minimum:

    w = scale * (u - offset) + minimum

- the levels' low four bits (or, for Q8_0, the whole int8 quant) and up to two further bit
  planes (bits 4 and 5: Q5_0/Q5_1/Q5_K one, Q6_K two);
- the scale per 32 weights (per 16 for Q6_K: two sub-blocks), an f16 of its own (Q4_0/Q4_1,
  Q5_0/Q5_1, Q8_0), or an integer (K-quants: 6-bit unsigned, Q6_K int8) times its super-block's
  f16 `d` (one per 256 weights);
- the minimum: none, an f16 of its own (Q4_1, Q5_1), or minus a 6-bit integer times the
  super-block's f16 `dmin` (Q4_K, Q5_K).

Packing (`pack`) regroups a matrix sixteen rows at a time, as the kernels read it: a *record*
holds one block of sixteen rows, element-major; K-quant records come eight to a super-block,
behind a header with the sixteen rows' `d` (and `dmin`). The levels and scales are the file's,
nothing is rounded: resident bytes are within 3% of the file's, and `dequantize` is bit for bit
gguf's (every product d * sc * (u - offset) is exact in float32; `+ minimum` rounds once).

Record layout, in order (offsets in bytes; R = `record_bytes`):
    low plane  nibbles: [16 pairs][16 rows], element 2p in the low nibble, 2p+1 in the high (256)
               bytes (Q8_0): [32 elements][16 rows] int8 (512)
    bit planes k = 0, 1: [8 quads j] of a little-endian uint64 whose bit 4r + i is bit 4 + k of
               the level of row r, element 4j + i (64 each)
    scales     per sub-block: f16 [16 rows] (32), or uint8/int8 [16 rows] (16)
    minimums   f16 [16 rows] (32), or uint8 [16 rows] (16)
Super-block header (K-quants): d f16 [16 rows], then dmin f16 [16 rows] where there is one.
A matrix of N rows and K columns is uint8 [G, K / (32 * per_super), super_bytes],
G = ceil(N / 16); rows past N are zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from engine.huge_pages import huge_page_empty

BLOCK = 32  # weights per block, along the input dimension
GROUP = 16  # rows per record: one row per lane of a 16-float vector
SUPER = 256  # weights per K-quant super-block

ScaleForm = Literal["f16", "u8", "i8"]
MinForm = Literal["f16", "u8"] | None


class RowFields(NamedTuple):
    """A quantized matrix by rows, in the traits' terms (what `decode` makes of a file's rows):
    levels q [N, K] (uint8; Q8_0's int8 quants), scales [N, K/32 * subs] (float16, or the
    K-quants' integers), minimums [N, K/32] (float16 or uint8) or None, and the K-quants'
    super-block d and dmin [N, K/256] float16 (None elsewhere)."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class BlockType:
    """One GGUF block type as the kernels read it (csrc/block_types.h has the same row)."""

    name: str
    code: int  # the `kind` the ops take (csrc/block_types.h's Kind)
    file_elements: int  # weights per block in the file (32, or 256 for K-quants)
    file_bytes: int  # bytes per block in the file
    lo_bits: Literal[4, 8]  # the low plane: nibbles, or Q8_0's int8 quants
    hi_planes: int  # further bit planes (bits 4, 5 of the level)
    offset: int  # the level's zero: w = scale * (u - offset) [+ minimum]
    subs: int  # scales per 32 weights (2: sub-blocks of 16)
    scale: ScaleForm
    minimum: MinForm
    decode: Callable[[np.ndarray], RowFields]  # the file's rows [N, bytes] -> RowFields

    @property
    def per_super(self) -> int:
        """Records per super-block: eight behind one header for K-quants, else one."""
        return SUPER // BLOCK if self.scale != "f16" else 1

    @property
    def lo_bytes(self) -> int:
        return GROUP * BLOCK // 2 if self.lo_bits == 4 else GROUP * BLOCK

    @property
    def scales_offset(self) -> int:
        return self.lo_bytes + 64 * self.hi_planes

    @property
    def scale_bytes(self) -> int:
        """Bytes of one sub-block's sixteen scales."""
        return GROUP * (2 if self.scale == "f16" else 1)

    @property
    def mins_offset(self) -> int:
        return self.scales_offset + self.subs * self.scale_bytes

    @property
    def record_bytes(self) -> int:
        mins = {None: 0, "f16": 2 * GROUP, "u8": GROUP}[self.minimum]
        return self.mins_offset + mins

    @property
    def header_bytes(self) -> int:
        if self.per_super == 1:
            return 0
        return 2 * GROUP * (2 if self.minimum == "u8" else 1)

    @property
    def super_bytes(self) -> int:
        return self.header_bytes + self.per_super * self.record_bytes

    @property
    def signed_levels(self) -> bool:
        return self.lo_bits == 8


# ---- the file's rows -> RowFields ------------------------------------------------------------


def _blocks(raw: np.ndarray, bt: BlockType) -> np.ndarray:
    """[N, bytes per row] -> [N, blocks per row, block bytes]."""
    return raw.reshape(raw.shape[0], -1, bt.file_bytes)


def _f16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes -> float16 [...]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0])


def _rows(q: np.ndarray) -> torch.Tensor:
    """[N, blocks, elements] -> [N, K] (owned)."""
    return torch.from_numpy(np.ascontiguousarray(q.reshape(q.shape[0], -1)))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy blocks' 16 bytes -> 32 nibbles: byte j holds element j (low) and j + 16 (high).
    Each half written in place (a concatenate would copy both halves once more)."""
    half = qs.shape[-1]
    out = np.empty((*qs.shape[:-1], 2 * half), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[..., :half])
    np.right_shift(qs, 4, out=out[..., half:])
    return out


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes -> bit 4 of each of the 32 levels (element j: bit j)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits << 4


def _decode_q4_0(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q4_0)
    return RowFields(_rows(_nibbles(b[..., 2:])), _f16(b[..., 0:2]))


def _decode_q4_1(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q4_1)
    return RowFields(_rows(_nibbles(b[..., 4:])), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _decode_q5_0(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q5_0)
    q = _nibbles(b[..., 6:]) | _high_bits_32(b[..., 2:6])
    return RowFields(_rows(q), _f16(b[..., 0:2]))


def _decode_q5_1(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q5_1)
    q = _nibbles(b[..., 8:]) | _high_bits_32(b[..., 4:8])
    return RowFields(_rows(q), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _decode_q8_0(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q8_0)
    return RowFields(_rows(b[..., 2:].view(np.int8)), _f16(b[..., 0:2]))


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and minimums: bytes 0-3 and 4-7
    hold sub-blocks 0-3's scales and minimums in their low six bits; bytes 8-11 hold sub-blocks
    4-7's low four bits (scale low nibble, minimum high), their top two bits in the top two bits
    of bytes 0-3 (scales) and 4-7 (minimums)."""
    lo_sc, lo_m, packed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=-1)
    m = np.concatenate([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 2) & 0x30)], axis=-1)
    return sc, m


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> 256 nibbles: chunk c of 32 bytes holds sub-block 2c in its low
    nibbles and 2c + 1 in its high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return ((chunks >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(
        *qs.shape[:-1], 256
    )


def _decode_q4_k(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q4_K)
    sc, m = _k_scales_mins(b[..., 4:16])
    return RowFields(
        _rows(_k_low_nibbles(b[..., 16:])),
        _rows(sc),
        _rows(m),
        _f16(b[..., 0:2]),
        _f16(b[..., 2:4]),
    )


def _decode_q5_k(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q5_K)
    sc, m = _k_scales_mins(b[..., 4:16])
    qh = b[..., 16:48]  # byte e, bit s: bit 4 of sub-block s's element e
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4
    q = _k_low_nibbles(b[..., 48:]) | high.reshape(*qh.shape[:-1], 256)
    return RowFields(_rows(q), _rows(sc), _rows(m), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _decode_q6_k(raw: np.ndarray) -> RowFields:
    b = _blocks(raw, Q6_K)
    lead = b.shape[:-1]
    ql, qh = b[..., 0:128], b[..., 128:192]
    # Half n of 128 weights: ql bytes 64n + j (j < 64) hold elements 128n + j (low nibble) and
    # 128n + 64 + j (high); qh byte 32n + l holds bits 4-5 of elements 128n + 32k + l in its
    # bits 2k, 2k + 1.
    low = (ql.reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    q = low.reshape(*lead, 256) | (high.reshape(*lead, 256) << 4)
    return RowFields(_rows(q), _rows(b[..., 192:208].view(np.int8)), None, _f16(b[..., 208:210]))


Q4_0 = BlockType("Q4_0", 7, 32, 18, 4, 0, 8, 1, "f16", None, _decode_q4_0)
Q4_1 = BlockType("Q4_1", 0, 32, 20, 4, 0, 0, 1, "f16", "f16", _decode_q4_1)
Q5_0 = BlockType("Q5_0", 2, 32, 22, 4, 1, 16, 1, "f16", None, _decode_q5_0)
Q5_1 = BlockType("Q5_1", 3, 32, 24, 4, 1, 0, 1, "f16", "f16", _decode_q5_1)
Q8_0 = BlockType("Q8_0", 1, 32, 34, 8, 0, 0, 1, "f16", None, _decode_q8_0)
Q4_K = BlockType("Q4_K", 4, 256, 144, 4, 0, 0, 1, "u8", "u8", _decode_q4_k)
Q5_K = BlockType("Q5_K", 5, 256, 176, 4, 1, 0, 1, "u8", "u8", _decode_q5_k)
Q6_K = BlockType("Q6_K", 6, 256, 210, 4, 2, 32, 2, "i8", None, _decode_q6_k)

# By name (ggml's type names), and by the ops' `kind` code (csrc/block_types.h's order).
BLOCK_TYPES: dict[str, BlockType] = {
    bt.name: bt for bt in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
}
BY_CODE: dict[int, BlockType] = {bt.code: bt for bt in BLOCK_TYPES.values()}


def block_type(kind: str | int) -> BlockType:
    """The traits of a type by name or code; ValueError for one no kernel covers."""
    table = BY_CODE if isinstance(kind, int) else BLOCK_TYPES
    if kind not in table:
        raise ValueError(
            f"no kernel covers block type {kind!r} (covered: {', '.join(BLOCK_TYPES)})"
        )
    return table[kind]  # type: ignore[index]


# ---- RowFields <-> packed records ------------------------------------------------------------


def pack(f: RowFields, bt: BlockType, into: torch.Tensor | None = None) -> torch.Tensor:
    """RowFields -> uint8 [G, NS, super_bytes] (rows padded with zeros to whole groups),
    written into `into` where given (a slice of a larger table's packed rows).

    Each field is written once, from a strided view of its rows, into its bytes of the packed
    matrix (which lives in huge pages): no grouped, transposed or joined copies in between."""
    n, k = f.q.shape
    groups, nb = -(-n // GROUP), k // BLOCK
    ns, per = nb // bt.per_super, bt.per_super
    pad = groups * GROUP - n
    if into is None:
        into = huge_page_empty(groups * ns * bt.super_bytes)
    out = into.view(groups, ns, bt.super_bytes)
    # [G, NS, records a super-block, record bytes]: a view of out behind each header.
    records = out[..., bt.header_bytes :].unflatten(-1, (per, bt.record_bytes))

    def record_bytes(start: int, width: int) -> torch.Tensor:  # [G, NS, per, width], of out
        return records[..., start : start + width]

    def by_record(t: torch.Tensor) -> torch.Tensor:  # [G, NB, ...] -> [G, NS, per, ...]
        return t.unflatten(1, (ns, per))

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [G, 16, ...], zero padded
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        return t.view(groups, GROUP, *t.shape[1:])

    # [G, 16 rows, NB, 32 elements] -> [G, NB, 32 elements, 16 rows]
    q = grouped(f.q.contiguous().view(torch.uint8)).view(groups, GROUP, nb, BLOCK)
    q = q.permute(0, 2, 3, 1)
    lo = record_bytes(0, bt.lo_bytes).unflatten(-1, (-1, GROUP))
    if bt.lo_bits == 4 and bt.hi_planes:  # the transposed levels once: nibbles and planes read it
        q = q.contiguous()
        low = q & 0x0F
        lo.copy_(by_record(low[:, :, 0::2] | (low[:, :, 1::2] << 4)))
    elif bt.lo_bits == 4:  # levels below 16 already: paired straight from the strided view
        lo.copy_(by_record(q[:, :, 0::2] | (q[:, :, 1::2] << 4)))
    else:
        lo.copy_(by_record(q))
    for plane in range(bt.hi_planes):  # [G, NB, 8 quads, 16 rows, 4] bits -> 8 bytes a quad
        bits = ((q >> (4 + plane)) & 1).reshape(groups, nb, 8, 4, GROUP).transpose(3, 4)
        packed = np.packbits(bits.reshape(groups, nb, 8, 64).numpy(), axis=-1, bitorder="little")
        plane_bytes = torch.from_numpy(packed).view(groups, nb, 64)
        record_bytes(bt.lo_bytes + 64 * plane, 64).copy_(by_record(plane_bytes))

    def per_block(t: torch.Tensor, start: int, subs: int) -> None:  # [N, NB*subs] -> its bytes
        g = grouped(t).view(groups, GROUP, nb, subs).permute(0, 2, 3, 1)
        dst = record_bytes(start, subs * GROUP * t.element_size()).view(t.dtype)
        dst.unflatten(-1, (subs, GROUP)).copy_(by_record(g))

    per_block(f.scales, bt.scales_offset, bt.subs)
    if f.mins is not None:
        per_block(f.mins, bt.mins_offset, 1)
    if per > 1:  # the super-blocks' d (and dmin), sixteen rows each, in front of the records
        for i, h in enumerate([f.d] if f.dmin is None else [f.d, f.dmin]):
            head = out[..., 2 * GROUP * i : 2 * GROUP * (i + 1)].view(torch.float16)
            head.copy_(grouped(h).permute(0, 2, 1))  # [G, NS, 16 rows]
    return out


def unpack(blocks: torch.Tensor, bt: BlockType, rows: int) -> RowFields:
    """pack's inverse: the first `rows` rows."""
    groups, ns, _ = blocks.shape
    nb = ns * bt.per_super
    records = blocks[..., bt.header_bytes :].reshape(groups, nb, bt.record_bytes)
    lo = records[..., : bt.lo_bytes]
    if bt.lo_bits == 4:
        pairs = lo.reshape(groups, nb, BLOCK // 2, GROUP)
        q = torch.stack([pairs & 0x0F, pairs >> 4], dim=3).reshape(groups, nb, BLOCK, GROUP)
    else:
        q = lo.reshape(groups, nb, BLOCK, GROUP).clone()
    for plane in range(bt.hi_planes):
        start = bt.lo_bytes + 64 * plane
        raw = records[..., start : start + 64].contiguous().numpy()
        bits = np.unpackbits(raw.reshape(groups, nb, 8, 8), axis=-1, bitorder="little")
        bits = torch.from_numpy(bits).view(groups, nb, 8, GROUP, 4).transpose(3, 4)
        q |= bits.reshape(groups, nb, BLOCK, GROUP) << (4 + plane)
    q = q.permute(0, 3, 1, 2).reshape(groups * GROUP, -1)[:rows].contiguous()
    if bt.signed_levels:
        q = q.view(torch.int8)

    dtypes = {"f16": torch.float16, "u8": torch.uint8, "i8": torch.int8}

    def per_block(start: int, per: int, form: str) -> torch.Tensor:  # -> [N, NB * per]
        width = per * GROUP * dtypes[form].itemsize
        raw = records[..., start : start + width].contiguous().view(dtypes[form])
        return raw.view(groups, nb, per, GROUP).permute(0, 3, 1, 2).reshape(-1, nb * per)[:rows]

    scales = per_block(bt.scales_offset, bt.subs, bt.scale)
    mins = None if bt.minimum is None else per_block(bt.mins_offset, 1, bt.minimum)
    d = dmin = None
    if bt.per_super > 1:

        def header(i: int) -> torch.Tensor:  # -> [N, NS] float16
            raw = blocks[..., 2 * GROUP * i : 2 * GROUP * (i + 1)].contiguous()
            return raw.view(torch.float16).permute(0, 2, 1).reshape(-1, ns)[:rows]

        d = header(0)
        dmin = header(1) if bt.minimum == "u8" else None
    return RowFields(q, scales, mins, d, dmin)


def effective_scales(f: RowFields, bt: BlockType) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 scale per sub-block [N, K/32 * subs] and minimum per block [N, K/32] (or None):
    the K-quants' d * sc and -(dmin * m), exact in float32 (11-bit times 8-bit mantissas)."""
    if bt.scale == "f16":
        scale = f.scales.float()
        return scale, None if f.mins is None else f.mins.float()
    per_super = bt.per_super * bt.subs
    scale = f.d.float().repeat_interleave(per_super, dim=1) * f.scales.float()  # type: ignore[union-attr]
    if f.mins is None:
        return scale, None
    dmin = f.dmin.float().repeat_interleave(bt.per_super, dim=1)  # type: ignore[union-attr]
    return scale, -(dmin * f.mins.float())


def dequantize_fields(f: RowFields, bt: BlockType) -> torch.Tensor:
    """float32 [N, K]: scale * (u - offset) + minimum, bit for bit gguf's dequantize."""
    n, k = f.q.shape
    scale, minimum = effective_scales(f, bt)
    per = BLOCK // bt.subs
    levels = f.q.to(torch.float32).view(n, -1, per)
    if bt.offset:
        levels = levels - bt.offset
    w = levels * scale.unsqueeze(-1)
    if minimum is not None:
        w = w.view(n, k // BLOCK, BLOCK) + minimum.unsqueeze(-1)
    return w.reshape(n, k)


def dequantize(blocks: torch.Tensor, bt: BlockType, rows: int) -> torch.Tensor:
    """float32 [rows, K] of packed blocks."""
    return dequantize_fields(unpack(blocks, bt, rows), bt)
