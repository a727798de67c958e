"""engine/kernels' layer ops (csrc/layer_ops.cpp) against their pure-torch definitions
(engine/kernels/reference.py), and the native decode attention against the gathered SDPA path.

Where the C++ kernels cannot be built the dispatcher runs the reference for both sides, so only
the comparisons of the C++ library itself are skipped, with the loader's reason."""

from __future__ import annotations

import pytest
import torch

from engine.attention.native_decode import native_decode_attention, unavailable_because
from engine.attention.triton_decode import DecodeShape, resolve_decode_attention
from engine.kernels import kernel_backend, reference
from engine.kv_cache import to_pool

native_only = pytest.mark.skipif(
    not kernel_backend().is_native, reason=f"C++ kernels not in use: {kernel_backend().reason}"
)
ops = torch.ops.jitney
CPU = torch.device("cpu")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@native_only
@pytest.mark.parametrize("width", [576, 64, 13])  # SmolLM2's hidden size, a head, a remainder
def test_norms_match_their_definition(width):
    g = _gen()
    x = torch.randn(5, width, generator=g) * 3
    w = torch.randn(width, generator=g)
    r = torch.randn(5, width, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    x_native, x_ref = x.clone(), x.clone()
    got = ops.add_rms_norm_(x_native, r, w, 1e-5)
    want = reference.add_rms_norm_(x_ref, r, w, 1e-5)
    torch.testing.assert_close(x_native, x_ref, rtol=0, atol=0)  # the residual add is exact
    torch.testing.assert_close(got, want)
    # Strided rows (a view of every other row) read where they lie.
    torch.testing.assert_close(ops.rms_norm(x[::2], w, 1e-5), reference.rms_norm(x[::2], w, 1e-5))


@native_only
@pytest.mark.parametrize("gate", ["silu_mul", "gelu_tanh_mul"])  # SwiGLU; Gemma's GeGLU
def test_gated_activations_match_their_definition(gate):
    gu = torch.randn(7, 2 * 1539, generator=_gen()) * 4  # 1539: a remainder past the vectors
    gu[0, :6] = torch.tensor([-200.0, -88.5, -87.5, 0.0, 88.5, 200.0])  # exp's clamps
    gu[0, 1539 : 1539 + 6] = 1.0
    torch.testing.assert_close(getattr(ops, gate)(gu), getattr(reference, gate)(gu))


@native_only
@pytest.mark.parametrize(
    ("qk_norms", "width"),
    # Llama; Qwen3's and Gemma's per-head norms; Phi's partial rotation; SmolLM3's layers
    # without RoPE.
    [(False, 64), (True, 64), (False, 48), (True, 0)],
)
def test_rope_write_kv_matches_its_definition(qk_norms, width):
    g = _gen(1)
    heads, kv_heads, d, tokens, num_slots = 9, 3, 64, 6, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    angles = torch.rand(tokens, width // 2, generator=g) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    norms = [torch.randn(d, generator=g) for _ in range(2)] if qk_norms else [None, None]
    caches = {}
    for name, fn in (("native", ops.rope_write_kv_), ("reference", reference.rope_write_kv_)):
        k_cache, v_cache = torch.zeros(num_slots, kv_heads, d), torch.zeros(num_slots, kv_heads, d)
        out = fn(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads, *norms, 1e-6)
        caches[name] = (out, k_cache, v_cache)
    for got, want in zip(caches["native"], caches["reference"], strict=True):
        torch.testing.assert_close(got, want)
    qk, k_cache, v_cache = caches["native"]
    unrotated = ops.rope_write_kv_(  # the part past the rotated width is kept as it is
        qkv, cos[:, :0], sin[:, :0], slots, k_cache.clone(), v_cache.clone(), heads, kv_heads,
        *norms, 1e-6,
    )  # fmt: skip
    torch.testing.assert_close(qk[..., width:], unrotated[..., width:], rtol=0, atol=0)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    v = qkv.view(tokens, -1, d)[:, heads + kv_heads :]
    assert torch.equal(v_cache[slots], v)  # V is copied as it is


@native_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_write_kv_rounds_into_a_16_bit_pool_as_torch_does(dtype):
    """`--kv-cache-dtype`: K and V are stored rounded to nearest even, the bits torch's
    .to(dtype) gives (so the Python path's writes and the kernel's agree), float16 saturated at
    its largest value rather than inf (which would make every score it meets NaN), nothing else
    written."""
    g = _gen(5)
    heads, kv_heads, d, tokens, num_slots = 9, 3, 64, 5, 30
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 3
    qkv[0, (heads + kv_heads) * d :: 7] = 1e6  # values past float16's range, both signs
    qkv[1, (heads + kv_heads) * d :: 5] = -3e5
    angles = torch.rand(tokens, d // 2, generator=g) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    k_cache = torch.zeros(num_slots, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros(num_slots, kv_heads, d, dtype=dtype)
    qk = ops.rope_write_kv_(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads, None, None, 0)
    assert qk.dtype == torch.float32  # Q and K leave in float32: attention computes in it
    v = qkv.view(tokens, -1, d)[:, heads + kv_heads :]
    assert torch.equal(v_cache[slots], to_pool(v, dtype))
    assert torch.equal(k_cache[slots], to_pool(qk[:, heads:], dtype))
    assert v_cache.isfinite().all() and k_cache.isfinite().all()
    if dtype == torch.float16:
        assert v_cache[slots[0]].max().item() == 65504 and v_cache[slots[1]].min().item() == -65504
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.rope_write_kv_(qkv, cos, sin, slots, ref_k, ref_v, heads, kv_heads, None, None, 0)
    assert torch.equal(ref_k, k_cache) and torch.equal(ref_v, v_cache)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rope_write_kv_(
            qkv, cos, sin, slots, k_cache, v_cache.float(), heads, kv_heads, None, None, 0
        )


@native_only
def test_rope_write_kv_refuses_a_slot_outside_the_cache():
    k_cache = v_cache = torch.zeros(4, 1, 8)
    qkv, cos = torch.zeros(1, 3 * 8), torch.ones(1, 8)
    with pytest.raises(RuntimeError, match="slot 4 out of range"):
        ops.rope_write_kv_(
            qkv, cos, cos, torch.tensor([4]), k_cache, v_cache, 1, 1, None, None, 1e-6
        )


def _pool(seed: int, num_blocks: int = 24, block_size: int = 16, kv_heads: int = 3, d: int = 64):
    g = _gen(seed)
    shape = (num_blocks, block_size, kv_heads, d)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), g


@native_only
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("d", [64, 128, 40])  # AVX-512's 4 and 8 vectors a head, then AVX2's
# Query heads per KV head, each read of a key or value serving up to four of them (two with
# d=128): 3 (SmolLM2's), 4 (Llama's), 5 (four, then one) and 1 (multi-head attention); all five
# rows (a task per KV head) or one (a task per query head).
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (10, 2), (4, 4)])
@pytest.mark.parametrize("rows", [5, 1])
def test_native_decode_matches_gathered_attention_in_place(window, d, heads, kv_heads, rows, isa):
    """Every instruction set's loop (AVX-512 for head sizes in 16s) equals gathered attention."""
    key_cache, value_cache, g = _pool(2, d=d, kv_heads=kv_heads)
    bs = 16
    # one key, a whole block, one more, long ones
    ctx = torch.tensor([333, 1, 16, 17, 100][:rows])
    tables = torch.stack([torch.randperm(24, generator=g) for _ in ctx])
    q = torch.randn(len(ctx), heads, d, generator=g)
    want = torch.empty_like(q)
    reference.paged_decode_(q, key_cache, value_cache, tables, ctx, d**-0.5, window or 0, want)
    # Strided query and output rows (views of a wider tensor), as the forward passes them.
    q_wide = torch.randn(len(ctx), heads + 3, d, generator=g)
    q_wide[:, :heads] = q
    out_wide = torch.zeros(len(ctx), heads + 3, d)
    native_decode_attention(
        q_wide[:, :heads], key_cache, value_cache, tables, ctx, d**-0.5, window, out_wide[:, :heads]
    )
    torch.testing.assert_close(out_wide[:, :heads], want, rtol=1e-5, atol=1e-5)
    assert not out_wide[:, heads:].any()  # nothing written beside the view
    assert bs == key_cache.shape[1]


@native_only
def test_native_decode_runs_a_verifications_rows_by_kv_head_with_the_same_results(isa):
    """A verification's rows (one sequence, one position apart, over the same blocks) are
    attended KV head by KV head: each row's result is bit for bit what it is when the rows are
    scattered among others (row by row), and equals gathered attention."""
    key_cache, value_cache, g = _pool(4, num_blocks=40)
    table, other = torch.randperm(40, generator=g)[:24], torch.randperm(40, generator=g)[:24]
    # Another sequence; a run of five (positions 200-204); the same blocks, not one position on
    # (a new run); the other sequence again.
    ctx = torch.tensor([50, 200, 201, 202, 203, 204, 150, 90])
    tables = torch.stack([other, table, table, table, table, table, table, other])
    q = torch.randn(len(ctx), 9, 64, generator=g)
    out, want = torch.empty_like(q), torch.empty_like(q)
    native_decode_attention(q, key_cache, value_cache, tables, ctx, 0.125, None, out)
    reference.paged_decode_(q, key_cache, value_cache, tables, ctx, 0.125, 0, want)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    scattered = torch.tensor([1, 0, 3, 7, 5, 2, 6, 4])  # no two rows of the run side by side
    out_scattered = torch.empty_like(q)
    native_decode_attention(
        q[scattered],
        key_cache,
        value_cache,
        tables[scattered],
        ctx[scattered],
        0.125,
        None,
        out_scattered,
    )
    assert torch.equal(out_scattered, out[scattered])


@native_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 40])  # AVX-512's loop, and AVX2's for any CPU
def test_native_decode_reads_a_16_bit_pool(dtype, d, isa):
    """A bfloat16 or float16 pool, widened as it is loaded, gives what gathered attention over
    the same values in float32 gives; a pool of the wrong kind is refused by name."""
    key_cache, value_cache, g = _pool(6, d=d)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    ctx = torch.tensor([333, 1, 17, 100])
    tables = torch.stack([torch.randperm(24, generator=g) for _ in ctx])
    q = torch.randn(len(ctx), 9, d, generator=g)
    want = torch.empty_like(q)
    reference.paged_decode_(q, key_cache.float(), value_cache.float(), tables, ctx, 0.2, 0, want)
    got = native_decode_attention(q, key_cache, value_cache, tables, ctx, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        native_decode_attention(q, key_cache.double(), value_cache.double(), tables, ctx, 0.2)


@native_only
def test_native_decode_refuses_a_context_its_table_does_not_hold():
    key_cache, value_cache, _ = _pool(3, num_blocks=4)
    q = torch.zeros(1, 9, 64)
    with pytest.raises(RuntimeError, match="does not fit its 2 blocks"):
        native_decode_attention(
            q, key_cache, value_cache, torch.tensor([[0, 1]]), torch.tensor([33]), 0.125
        )


def test_auto_takes_the_native_kernel_on_a_cpu_where_it_serves_the_pool():
    shape = DecodeShape(9, 3, 64, 16, torch.float32)
    kernel, why = resolve_decode_attention("auto", CPU, shape)
    if kernel_backend().is_native:
        assert (kernel, why) == ("native", None)
        assert resolve_decode_attention("native", CPU, shape) == ("native", None)
    else:
        assert kernel is None and "C++ kernels are not in use" in why
    bf16 = DecodeShape(9, 3, 64, 16, torch.bfloat16)  # a bfloat16 model's pool
    kernel, why = resolve_decode_attention("auto", CPU, bf16)
    assert kernel is None and why == unavailable_because(CPU, torch.bfloat16, 64)
    assert "float32" in why
    with pytest.raises(ValueError, match=r"--decode-attention native: .*float32"):
        resolve_decode_attention("native", CPU, bf16)
    # A float32 model's 16-bit pool (--kv-cache-dtype) is the kernel's to read.
    for dtype in (torch.bfloat16, torch.float16):
        half_pool = DecodeShape(9, 3, 64, 16, dtype, torch.float32)
        if kernel_backend().is_native:
            assert resolve_decode_attention("auto", CPU, half_pool) == ("native", None)
    assert "pools" in unavailable_because(CPU, torch.float64, 64, torch.float32)
    assert resolve_decode_attention("gather", CPU, shape) == (None, None)
