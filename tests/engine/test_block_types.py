"""engine/kernels/block_types.py's traits table and the kernels that read it: every covered GGUF
block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on random blocks, against the `gguf`
package's own numpy dequantization, at every instruction set this CPU has; fused projections
whose parts are of different types; and a GGUF file of such matrices through the model.

gguf can dequantize K-quants but not make them, so the blocks are random bytes with sane f16
scales written over their scale fields (`random_file_blocks`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from engine.kernels import BlockWeights, kernel_backend, linear_parts, reference
from engine.kernels.block_types import BLOCK_TYPES, block_type, unpack
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.layers.quantized import QuantizedLinear
from engine.models.gguf_weights import read_gguf_tensors
from engine.models.llama import LlamaForward
from engine.models.weight_sources import GGUFWeights
from tests.engine.test_fused_forward import _step
from tests.engine.test_paged_attention import BlockPool, rand_tokens
from tests.engine.test_quant_kernels import (
    EXACT,
    INT8_ACTIVATIONS,
    assert_linear_matches,
    int8_activations,
    random_file_blocks,
)

KINDS = tuple(BLOCK_TYPES)
ISAS = kernel_backend().available_isas()
TOKENS = (1, 2, 7, 8, 13)


def gguf_dense(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[kind])))


def packed(kind: str, n: int, k: int, seed: int = 0) -> tuple[BlockWeights, np.ndarray]:
    raw = random_file_blocks(kind, n, k, seed)
    return BlockWeights.from_gguf(kind, raw, (n, k)), raw


@pytest.mark.parametrize("kind", KINDS)
def test_packing_is_gguf_bit_for_bit_and_close_to_the_files_bytes(kind) -> None:
    """Decoding a file's rows into levels and scales and packing them loses nothing: the packed
    matrix dequantizes to gguf's floats exactly, a row of its table too, and unpacking
    round-trips; resident bytes are within 3% of the file's (rows padded to groups of 16
    aside)."""
    w, raw = packed(kind, 48, 512)
    dense = gguf_dense(raw, kind)
    assert torch.equal(w.dequantize(), dense)
    assert torch.equal(reference.quant_embedding(torch.arange(48), w.blocks, w.code, 48), dense)
    ids = torch.tensor([[0, 47], [5, 5]])
    assert torch.equal(w.embedding(ids), dense[ids])
    assert torch.equal(BlockWeights.from_fields(kind, w.fields()).blocks, w.blocks)
    assert w.nbytes <= 1.03 * raw.nbytes
    padded = unpack(w.blocks, block_type(kind), 48)
    assert padded.q.shape == (48, 512)


def test_the_traits_table_is_the_kernels_table() -> None:
    """Python's traits (block_types.py) and C++'s (csrc/blocks.h) agree: each type's packed
    matrix has the super-block width both compute, and the C++ ops accept it under its code."""
    codes = sorted(bt.code for bt in BLOCK_TYPES.values())
    assert codes == list(range(len(BLOCK_TYPES)))
    widths = {
        "Q4_1": 320, "Q8_0": 544, "Q5_0": 352, "Q5_1": 384,
        "Q4_K": 64 + 8 * 288, "Q5_K": 64 + 8 * 352, "Q6_K": 32 + 8 * 416, "Q4_0": 288,
    }  # fmt: skip
    assert {k: bt.super_bytes for k, bt in BLOCK_TYPES.items()} == widths
    for kind in KINDS:
        w, _ = packed(kind, 16, 256)
        assert w.blocks.shape[2] == widths[kind]
        assert w.linear(torch.randn(1, 256)).shape == (1, 16)


@pytest.mark.parametrize("kind", KINDS)
def test_every_type_multiplies_as_stored_at_every_instruction_set(kind, isa) -> None:
    """linear(x) == x @ dequantize(blocks).T for tiles of every size, by the one pass of each
    instruction set (and, where there is one, the batched path); the integer one passes also
    compute exactly the arithmetic reference.py states, to float32 rounding."""
    gen = torch.Generator().manual_seed(1)
    w, raw = packed(kind, 77, 768, seed=2)
    dense = gguf_dense(raw, kind)
    for path, limit in (("one-pass", 1 << 30), ("batched", 1)):
        w = dataclasses.replace(w, batched_min_tokens=limit)
        for t in TOKENS:
            x = torch.randn(t, 768, generator=gen)
            y = w.linear(x)
            # AMX's tiles take Q4_1 and Q8_0; the other types keep its (VNNI) one pass.
            bf16 = isa == "amx" and path == "batched" and kind in ("Q4_1", "Q8_0")
            integer = int8_activations(isa, "one-pass") and (path == "one-pass" or isa == "amx")
            tol = 8e-3 if bf16 else INT8_ACTIVATIONS if integer else EXACT
            assert_linear_matches(y, x, dense, tol)
            if integer and not bf16:
                want = reference.quant_linear_int8_activations(x, w.blocks, kind, w.rows)
                scale = x.double().abs() @ dense.double().abs().T
                assert ((y.double() - want).abs() / scale).max().item() <= EXACT, (kind, isa, t)


def test_a_fused_projection_keeps_each_part_in_its_own_type(isa) -> None:
    """Q5_0 Q and K beside a Q8_0 V (Gemma's attention in a Q4_K_M file), and Q6_K beside Q4_K:
    one call computes every part, each part's product is what it gives alone, and neighbouring
    parts of one type become one matrix."""
    q, _ = packed("Q5_0", 64, 512, 1)
    k, _ = packed("Q5_0", 32, 512, 2)
    v, _ = packed("Q8_0", 32, 512, 3)
    layer = QuantizedLinear([q, k, v], None)
    assert layer.kinds == ("Q5_0", "Q8_0") and layer.parts[0].rows == 96
    gate, _ = packed("Q4_K", 40, 512, 4)
    up, _ = packed("Q6_K", 40, 512, 5)
    gen = torch.Generator().manual_seed(7)
    for parts in ([q, k, v], [gate, up]):
        dense = torch.cat([p.dequantize() for p in parts])
        for t in (1, 5, 70):
            x = torch.randn(t, 512, generator=gen)
            y = linear_parts(x, parts)
            alone = torch.cat([p.linear(x) for p in parts], dim=1)
            assert torch.equal(y, alone)
            tol = INT8_ACTIVATIONS if int8_activations(isa, "one-pass") else EXACT
            assert_linear_matches(y, x, dense, tol)
    with pytest.raises(ValueError, match="one type"):
        BlockWeights.cat([q, v])


# ---- a GGUF file of every type, through the model -------------------------------------------

# A small Llama whose every matrix is 256-aligned, each projection part in its own type.
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 512
MATRIX_KINDS = {
    "attn_q": "Q5_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_K",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q5_1",
    "ffn_down": "Q6_K",
}


def write_block_type_model(path: Path) -> Path:
    """A GGUF file (written with the gguf package) of a small Llama: per layer, its matrices in
    the types above (fused Q/K/V and gate/up of mixed types); a Q6_K tied embedding table."""
    head_dim = HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    seed = 0

    def add(name: str, kind: str, shape: tuple[int, int]) -> None:
        nonlocal seed
        seed += 1
        raw = random_file_blocks(kind, *shape, seed=seed, size=0.15)
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", "Q6_K", (VOCAB, HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        for part, kind in MATRIX_KINDS.items():
            add(f"blk.{i}.{part}.weight", kind, shapes[part])
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=256,
    )  # fmt: skip


def test_a_file_of_every_type_runs_in_its_blocks_and_decodes_in_one_call(tmp_path) -> None:
    """Read from a GGUF file, each matrix stays in its type (the mixed fused projections as
    parts), the decode op takes them, and every step's logits are the dequantized model's within
    the rounding of int8 activations."""
    _, tensors = read_gguf_tensors(write_block_type_model(tmp_path / "types.gguf"))
    config = _config()
    fused = LlamaForward(
        config, GGUFWeights(tensors, torch.float32, quantized=True), fused_ops=True
    )
    dense = LlamaForward(config, GGUFWeights(tensors, torch.float32, quantized=False))
    assert fused.layers[0].qkv.kinds == ("Q5_0", "Q4_0", "Q8_0")
    assert fused.layers[0].gate_up.kinds == ("Q5_K", "Q5_1")
    assert fused.lm_head.kinds == ("Q6_K",)
    assert fused._decode_layers is not None
    spec = KVCacheSpec.from_model_config(config, torch.float32, 4)
    caches = {
        name: PagedKVCache(spec, 64, decode_kernel=k) for name, k in (("f", "native"), ("d", None))
    }
    pool = BlockPool(64, seed=3)
    seqs = [(rand_tokens(24, seed=8), pool.take(6)), (rand_tokens(24, seed=9), pool.take(6))]
    steps = [[(0, 9), (0, 6)], *[[(9 + i, 1), (6 + i, 1)] for i in range(5)]]
    one_call = 0
    for step in steps:
        entries = [(toks, s, n, table) for (toks, table), (s, n) in zip(seqs, step, strict=True)]
        got, decode_only = _step(fused, caches["f"], entries)
        want, _ = _step(dense, caches["d"], entries)
        one_call += decode_only
        spread = (want.max() - want.min()).item()
        assert (got - want).abs().max().item() < 0.02 * spread
    assert one_call == 5


def test_a_large_table_packs_slice_by_slice_as_a_whole(monkeypatch) -> None:
    """Past PACK_ROWS rows a table is decoded and packed a slice at a time (its temporaries
    stay small): the same bytes as packing it whole, and each slice reported once packed."""
    from engine.kernels import packed_weights
    from engine.kernels.block_types import block_type

    raw = random_file_blocks("Q6_K", 77, 512, seed=9)
    whole = BlockWeights.from_fields("Q6_K", block_type("Q6_K").decode(raw))
    monkeypatch.setattr(packed_weights, "PACK_ROWS", 32)
    seen: list[int] = []
    sliced = BlockWeights.from_gguf("Q6_K", raw, (77, 512), lambda rows: seen.append(len(rows)))
    assert torch.equal(sliced.blocks, whole.blocks) and sliced.rows == 77
    assert seen == [32, 32, 13]


def test_a_packed_tensors_file_pages_leave_the_process(tmp_path) -> None:
    """release_pages drops a memory-mapped view's whole pages from this process's resident
    memory; the view still reads the file's bytes after."""
    from engine.models.gguf_index import release_pages

    path = tmp_path / "pages.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 * 4096, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, mode="r")
    view = mapped[4096 + 100 : 60 * 4096]

    def resident_kb() -> int:
        smaps = Path("/proc/self/smaps").read_text().split("\n")
        for i, line in enumerate(smaps):
            if line.endswith(str(path)):
                return int(next(s for s in smaps[i:] if s.startswith("Rss:")).split()[1])
        return 0

    assert int(view.sum()) == int(data[4096 + 100 : 60 * 4096].sum())  # every page read
    before = resident_kb()
    release_pages(view)
    assert before >= 58 * 4 and resident_kb() <= before - 57 * 4  # 58 whole pages let go
    assert np.array_equal(view, data[4096 + 100 : 60 * 4096])
