"""The Triton decode kernel (engine/attention/triton_decode.py), run here under Triton's CPU
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): the attention of each row over its own
blocks, the engine's tokens through it, its capture as a graph, and when the engine picks it."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention import paged_attention
from engine.attention.triton_decode import (
    DecodeShape,
    paged_decode_attention,
    resolve_decode_attention,
    self_check,
)
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_greedy_parity, make_engine
from tests.engine.graph_emulator import EmulatedGraphCapture, kernel_as_op

CPU = torch.device("cpu")


def reference(q, k_cache, v_cache, tables, ctx, scale, window):
    """Row by row: its blocks gathered, cut to its context (and window), SDPA in float64."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    rows = []
    for b in range(q.shape[0]):
        n = int(ctx[b])
        blocks = tables[b, : -(-n // k_cache.shape[1])]
        lo = 0 if window is None else max(0, n - window)
        k = k_cache[blocks].flatten(0, 1)[lo:n].double().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[blocks].flatten(0, 1)[lo:n].double().repeat_interleave(heads // kv_heads, 1)
        o = F.scaled_dot_product_attention(
            q[b].double()[:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )
        rows.append(o[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (12, 3)])
@pytest.mark.parametrize("window", [None, 21])
def test_each_row_attends_its_own_blocks_up_to_its_context(dtype, heads, kv_heads, window):
    """Contexts of 1, a block edge, a tile edge (64) and one past it; tables in random order with
    junk ids past each context (never read: the context masks them), GQA groups of 1, 3 and 4."""
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    block_size, num_blocks, head_dim = 16, 48, 32
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor([1, 16, 64, 65, 150])
    q = torch.randn(len(ctx), heads, head_dim, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:12] for _ in ctx])
    scale = head_dim**-0.5
    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, window)
    want = reference(q, k_cache, v_cache, tables, ctx, scale, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and (got.double() - want).abs().max() < tolerance


def test_it_writes_into_a_strided_view_and_nothing_beside_it():
    k_cache = torch.randn(8, 4, 2, 16)
    v_cache = torch.randn(8, 4, 2, 16)
    q = torch.randn(3, 4, 16)
    tables, ctx = torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.tensor([5, 8, 2])
    packed = torch.full((5, 4, 16), 7.0)  # rows 1..3 are the decodes of a packed step
    paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, out=packed[1:4])
    want = reference(q, k_cache, v_cache, tables, ctx, 0.25, None)
    assert torch.allclose(packed[1:4].double(), want, atol=1e-5)
    assert (packed[0] == 7).all() and (packed[4] == 7).all()


def _requests(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(8, 280) for _ in range(rng.randint(3, 50))], rng.randint(8, 20))
        for _ in range(6)
    ]


def _run(engine: Engine, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Half at once, the rest joining at step 4; greedy."""
    outputs: dict[int, list[int]] = {}
    steps = 0
    while engine.has_unfinished() or len(outputs) < len(requests):
        if steps in (0, 4):
            for i in range(len(outputs), len(outputs) + len(requests) // 2):
                prompt, n = requests[i]
                engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0))
                outputs[i] = []
        for out in engine.step():
            outputs[int(out.request_id)] += out.new_token_ids
        steps += 1
    return [outputs[i] for i in range(len(requests))]


def _engine(decode_attention: str) -> Engine:
    return make_engine(
        load_model("tiny-random"),
        kv_cache_memory="48KiB",  # small enough to preempt
        max_num_seqs=8,
        max_num_batched_tokens=32,  # long prompts are chunked
        decode_attention=decode_attention,
    )


def test_the_engine_gives_the_gather_paths_tokens_eagerly_and_as_graphs(ref, monkeypatch):
    """Joins, chunked prefill and preemption, through the kernel: eagerly, then with decode
    steps captured and replayed under the CPU emulation of CUDA graphs."""
    monkeypatch.setattr(paged_attention, "paged_decode_attention", kernel_as_op)
    requests = _requests(3)
    gather = _engine("gather")
    want = _run(gather, requests)
    assert gather.stats.num_preemptions_total > 0
    kernel = _engine("triton")
    assert kernel.kv_cache.decode_kernel == "triton"
    for prompt, got, expected in zip(requests, _run(kernel, requests), want, strict=True):
        assert_greedy_parity(ref, prompt[0], got, expected)
    graphed = _engine("triton")
    capture = EmulatedGraphCapture()
    graphed.runner.enable_decode_graphs(8, graphed.max_model_len, capture)
    graphs = graphed.runner.graphs
    assert graphs is not None
    # The kernel reads each row's own context, so one width serves every step: each batch
    # bucket's graph is captured at start, and no step captures one mid-run.
    at_start = {(batch, graphs.max_width) for batch in graphs.buckets}
    assert set(graphs.graphs) == at_start and len(capture.graphs) == len(at_start) == 4
    for prompt, got, expected in zip(requests, _run(graphed, requests), want, strict=True):
        assert_greedy_parity(ref, prompt[0], got, expected)
    assert graphs.failed is None and graphs.num_steps > 10
    assert set(graphs.graphs) == at_start and len(capture.graphs) == len(at_start)
    # Each capture replays once (a capture computes nothing), then one replay per step.
    assert sum(g.replays for g in capture.graphs) == len(at_start) + graphs.num_steps
    assert not graphed.kv_cache._workspace_fixed  # graphs read no workspace: none reserved
    graphed.block_manager.check_integrity()


def test_auto_takes_the_kernel_on_cuda_only_and_triton_says_why_it_cannot(monkeypatch):
    def shape(head_dim: int = 16, dtype: torch.dtype = torch.float32) -> DecodeShape:
        return DecodeShape(8, 2, head_dim, 16, dtype)

    cuda = torch.device("cuda")
    assert resolve_decode_attention("gather", cuda, shape()) == (None, None)
    kernel, _ = resolve_decode_attention("auto", CPU, shape())  # the interpreter is for tests
    assert kernel != "triton"  # (the CPU's in-place kernel is native: test_layer_ops.py)
    assert resolve_decode_attention("triton", CPU, shape()) == ("triton", None)  # self-check
    use, why = resolve_decode_attention("auto", cuda, shape(head_dim=96))
    assert not use and "96" in why  # not a power of two
    with pytest.raises(ValueError, match="96"):
        resolve_decode_attention("triton", CPU, shape(head_dim=96))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="interpreter"):
        resolve_decode_attention("triton", CPU, shape())
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="flash")


def test_a_kernel_that_fails_its_self_check_is_not_used():
    """The interpreter cannot run bf16 (tests/conftest.py): like a Triton that cannot build the
    kernel on some machine, the self-check fails, "auto" would fall back, "triton" refuses."""
    bf16 = DecodeShape(8, 2, 16, 16, torch.bfloat16)
    why = self_check(CPU, bf16)
    assert why is not None and "self-check" in why
    with pytest.raises(ValueError, match="self-check"):
        resolve_decode_attention("triton", CPU, bf16)
