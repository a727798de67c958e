"""engine/models/gguf_index.py against gguf's own GGUFReader: the same tensors (names, types,
dims, the bytes in the same dtype and shape) and the same metadata scalars, on the bundled
SmolLM2 file and on files written with every kind of value; and the files it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from engine.models.gguf_index import read_gguf_index
from engine.models.model_loader import smollm2_gguf_path


def reader_scalars(reader: GGUFReader) -> dict[str, object]:
    """GGUFReader's metadata scalars and strings (its own GGUF.* header fields left out)."""
    found: dict[str, object] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or field.types[0] == GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        found[name] = bytes(value).decode() if field.types[0] == GGUFValueType.STRING else value[0]
    return found


def assert_same_as_gguf_reader(path: Path) -> None:
    index, reader = read_gguf_index(path), GGUFReader(str(path))
    assert index.metadata == reader_scalars(reader)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(index.tensors, reader.tensors, strict=True):
        assert mine.qtype == int(theirs.tensor_type)
        assert mine.dims == tuple(int(d) for d in theirs.shape)
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape)
        assert np.array_equal(mine.data, theirs.data, equal_nan=True), mine.name


def test_the_bundled_model_s_file_reads_as_gguf_reader_reads_it():
    path = smollm2_gguf_path()
    assert_same_as_gguf_reader(path)
    index = read_gguf_index(path)
    assert index.metadata["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in index.metadata  # arrays are stepped over
    assert len(index.tensors) == 272


def write(path: Path, alignment: int | None = None, endian=GGUFEndian.LITTLE) -> Path:
    w = GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 700)
    w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 0.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve ✓")
    w.add_array("t.tokens", ["a", "bé", "", "long " * 50])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.after", "read past every array")
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_written_files_of_every_value_kind_read_as_gguf_reader_reads_them(tmp_path, alignment):
    path = write(tmp_path / "t.gguf", alignment)
    assert_same_as_gguf_reader(path)
    index = read_gguf_index(path)
    assert index.metadata["t.after"] == "read past every array"
    assert index.metadata["t.str"] == "naïve ✓" and index.metadata["t.bool"] is True
    assert {t.name: t.data.shape for t in index.tensors}["q8"] == (4, 68)  # 2 blocks of 34 bytes


def test_files_it_cannot_read_are_refused_by_name(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_index(junk)
    whole = write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:-40])
    with pytest.raises(ValueError, match="run past the end of the file"):
        read_gguf_index(cut)
    future = tmp_path / "v9.gguf"
    future.write_bytes(whole[:4] + (9).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="GGUF version 9"):
        read_gguf_index(future)
    big = write(tmp_path / "big.gguf", endian=GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian"):
        read_gguf_index(big)


def patched(tmp_path: Path, name: str, old: bytes, new: bytes) -> Path:
    """A written file with the header's first `old` replaced by `new` (the same length)."""
    data = write(tmp_path / f"{name}-source.gguf", alignment=64).read_bytes()
    assert len(old) == len(new) and old in data
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data.replace(old, new, 1))
    return path


def test_a_header_it_cannot_trust_is_refused_by_name(tmp_path):
    key = b"general.alignment"
    alignment_of_48 = patched(
        tmp_path,
        "align",
        key + (4).to_bytes(4, "little") + (64).to_bytes(4, "little"),
        key + (4).to_bytes(4, "little") + (48).to_bytes(4, "little"),
    )
    with pytest.raises(ValueError, match="alignment must be a power of two, got 48"):
        read_gguf_index(alignment_of_48)
    name = (3).to_bytes(8, "little")
    twice = patched(tmp_path, "twice", name + b"f16", name + b"f32")
    with pytest.raises(ValueError, match="a tensor name occurs twice"):
        read_gguf_index(twice)
    unknown = patched(
        tmp_path, "kind", b"t.u8" + (0).to_bytes(4, "little"), b"t.u8" + (99).to_bytes(4, "little")
    )
    with pytest.raises(ValueError, match="value of unknown type 99"):
        read_gguf_index(unknown)
