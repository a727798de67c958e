"""A GGUF file's header, read fast: its metadata's scalars and where each tensor's bytes are.

gguf's own `GGUFReader` makes a numpy view for every element of every metadata array as it opens
a file. For the bundled SmolLM2 that is its 49,152 tokens and 48,900 merges: about 4 s a read on
a 2-core Zen 3, and an engine start read the file twice. The engine needs the scalars
(architecture, head counts, alignment) and the tensors, so this reads the header with `struct`,
steps over the arrays (or reads the few a caller names: the vocabulary, once, for its
tokenizer), and maps each tensor's bytes as `GGUFReader` does: the same dtype and shape
(tests/engine/test_gguf_index.py compares the two on SmolLM2's file and on written ones).
Little-endian files only: a byte-swapped (big-endian) one is refused by name.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # gguf.GGUFValueType
_LENGTH = struct.Struct("<Q")  # a string's length, before its bytes
# Scalar value types: struct format (little-endian).
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml's order: innermost first
    qtype: int  # ggml's type id (gguf.GGMLQuantizationType)
    data: np.ndarray  # as GGUFReader's ReaderTensor.data: values, or [.., bytes a row] of blocks


@dataclass(frozen=True, slots=True)
class GGUFMetadata:
    metadata: dict[str, object]  # scalars and strings; arrays are stepped over, not kept
    arrays: dict[str, list[object]]  # the arrays the caller named, where the file has them


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    metadata: dict[str, object]  # scalars and strings; arrays are stepped over, not kept
    tensors: list[TensorInfo]
    arrays: dict[str, list[object]] = field(default_factory=dict)  # those the caller named
    # sha256 of the header (metadata and tensor table): what the file says of itself, its
    # tokenizer included; the same for a copy of the file anywhere.
    header_digest: str = ""


def read_gguf_metadata(path: str | Path, arrays: Collection[str] = ()) -> GGUFMetadata:
    """The metadata alone (no tensor table), and the arrays named in `arrays`."""
    _, _, metadata, kept = _open(path, arrays)
    return GGUFMetadata(metadata, kept)


def read_gguf_index(path: str | Path, arrays: Collection[str] = ()) -> GGUFIndex:
    """The metadata, the arrays named in `arrays`, and every tensor's bytes (memory-mapped)."""
    reader, num_tensors, metadata, kept = _open(path, arrays)
    data = reader.data
    infos = []
    for _ in range(num_tensors):
        name = reader.string()
        dims = tuple(reader.unpack("<Q") for _ in range(reader.unpack("<I")))
        infos.append((name, dims, reader.unpack("<I"), reader.unpack("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
    start = -(-reader.offset // alignment) * alignment
    names = [name for name, *_ in infos]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a tensor name occurs twice")
    tensors = [
        TensorInfo(name, dims, qtype, _tensor_data(data, start + offset, dims, qtype))
        for name, dims, qtype, offset in infos
    ]
    digest = hashlib.sha256(reader.buf[: reader.offset]).hexdigest()
    release_pages(data[: reader.offset])  # the header is read: its vocabulary's pages can go
    return GGUFIndex(metadata, tensors, kept, digest)


def _open(
    path: str | Path, arrays: Collection[str]
) -> tuple[_Reader, int, dict[str, object], dict[str, list[object]]]:
    """The header read up to the tensor table: (reader there, tensor count, scalars, arrays)."""
    data = np.memmap(path, mode="r")
    buf = memoryview(data)  # type: ignore[arg-type]
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:
        raise ValueError(f"{path}: a big-endian GGUF file; Jitney reads little-endian ones")
    if version not in VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} (Jitney reads {VERSIONS})")
    num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
    reader = _Reader(data, buf, 24)
    metadata: dict[str, object] = {}
    kept: dict[str, list[object]] = {}
    for _ in range(num_kv):
        key = reader.string()
        kind = reader.unpack("<I")
        if kind == ARRAY and key in arrays:
            kept[key] = reader.array()
            continue
        value = reader.value(kind)
        if value is not None:
            metadata[key] = value
    return reader, num_tensors, metadata, kept


def _tensor_data(data: np.ndarray, offset: int, dims: tuple[int, ...], qtype: int) -> np.ndarray:
    """The tensor's bytes as GGUFReader views them: float and integer types as their values in
    numpy's order (dims reversed), block types as uint8 rows of whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    kind = GGMLQuantizationType(qtype)
    shape = tuple(reversed(dims))
    count = math.prod(dims)
    dtype = _PLAIN_TYPES.get(kind.name)
    if dtype is None:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        count = count * type_size // block_size
        dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, kind)
    end = offset + count * dtype.itemsize
    if end > len(data):
        raise ValueError(f"a tensor's bytes run past the end of the file ({end} > {len(data)})")
    return data[offset:end].view(dtype).reshape(shape)


_PLAIN_TYPES = {
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}


class _Reader:
    """Reads the header's values in order from `offset`."""

    def __init__(self, data: np.ndarray, buf: memoryview, offset: int):
        self.data, self.buf, self.offset = data, buf, offset

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        text = bytes(self.buf[self.offset : self.offset + size]).decode("utf-8")
        self.offset += size
        return text

    def value(self, kind: int) -> object:
        """A value of type `kind`; an array is stepped over (None)."""
        if kind == STRING:
            return self.string()
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind != ARRAY:
            raise ValueError(f"GGUF metadata value of unknown type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in SCALARS:
            self.offset += count * struct.calcsize(SCALARS[item])
        elif item == STRING:  # a vocabulary: 262,144 strings for Gemma, stepped in a tight loop
            offset, length, buf = self.offset, _LENGTH.unpack_from, self.buf
            for _ in range(count):
                offset += 8 + length(buf, offset)[0]
            self.offset = offset
        else:
            for _ in range(count):
                self.value(item)
        return None

    def array(self) -> list[object]:
        """An array's values (strings decoded, numbers as Python numbers)."""
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in SCALARS:
            fmt = SCALARS[item]
            values = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.offset)
            self.offset += count * struct.calcsize(fmt)
            return list(values)
        return [self.value(item) if item != ARRAY else self.array() for _ in range(count)]


def release_pages(array: np.ndarray) -> None:
    """Drop the pages of a view into a file's memory map from this process (they stay in the
    page cache; reading the view again faults them back in). A file's blocks are packed once:
    without this, every page read while packing would stay in the process's resident memory
    until the whole map is closed, the file's size on top of the packed weights."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    mm = getattr(root, "_mmap", None)
    if mm is None or array.nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = array.ctypes.data - root.ctypes.data
    first = start // page * page
    end = start + array.nbytes
    # Only whole pages the view covers: a neighbour's page may still be wanted.
    first += page if first < start else 0
    last = end // page * page
    if last > first:
        mm.madvise(mmap.MADV_DONTNEED, first, last - first)
