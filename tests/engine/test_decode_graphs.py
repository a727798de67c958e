"""Decode-only steps at padded, fixed shapes (engine/runner/decode_graphs.py). On CUDA they
replay as CUDA graphs; here the same padded path runs without capture, and must give what the
eager path gives under joins, chunked prefill and preemption, without touching any real block
through its padding rows."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from engine.runner.decode_graphs import (
    batch_buckets,
    decode_read_bytes,
    graph_reserved_bytes,
    width_bucket,
)
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_greedy_parity, make_engine
from tests.engine.graph_emulator import EmulatedGraphCapture

MODEL = "tiny-random"


def test_batch_buckets_cover_every_size_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(64) == [1, 2, 4, *range(8, 65, 8)]
    for n in range(1, 70):
        assert next(b for b in batch_buckets(64 if n <= 64 else n) if b >= n) >= n


def test_width_buckets_are_powers_of_two_from_four():
    assert [width_bucket(b) for b in (1, 4, 5, 8, 9, 33)] == [4, 4, 8, 8, 16, 64]


def test_the_reserved_workspace_covers_every_step_graphs_take():
    """Graphs keep the workspace at its largest padded read; a step that fits never reads more."""
    engine = _engine(True, EmulatedGraphCapture())
    graphs, cache = engine.runner.graphs, engine.kv_cache
    assert graphs is not None
    reserved = cache._workspace.numel() * cache.spec.dtype_size
    assert reserved == graphs.workspace_bytes() > 0
    for batch in range(1, 13):
        for ctx in range(1, engine.max_model_len + 1, 7):
            if graphs.fits(batch, ctx):
                padded = next(b for b in graphs.buckets if b >= batch)
                width = width_bucket(-(-ctx // cache.block_size))
                assert padded * width * cache.spec.read_bytes_per_block <= reserved
    spec = KVCacheSpec(32, 8, 128, torch.bfloat16, 16)  # Llama 3.1 8B: 64 KiB per block read
    assert spec.read_bytes_per_block == 64 * 1024
    assert decode_read_bytes(spec, 256, 512, 1 << 30) == 1 << 30  # capped
    assert decode_read_bytes(spec, 4, 8, 1 << 30) == 4 * 8 * 64 * 1024
    # The KV budget leaves free the shared logits buffer, plus the workspace on the gather path.
    logits = 4 * 128256 * 2
    assert graph_reserved_bytes(spec, 4, 128, 128256, decode_kernel="triton") == logits
    assert graph_reserved_bytes(spec, 4, 128, 128256, decode_kernel=None) == logits + 4 * 8 * 65536


def _requests(seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(8, 280) for _ in range(rng.randint(3, 70))], rng.randint(10, 60))
        for _ in range(20)
    ]


def _run(engine: Engine, requests: list[tuple[list[int], int]]) -> dict[str, list[int]]:
    """Half the requests at once, the rest joining at step 7; greedy."""
    outputs: dict[str, list[int]] = {}

    def add(first: int, last: int) -> None:
        for i in range(first, last):
            prompt, n = requests[i]
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0))
            outputs[str(i)] = []

    half = len(requests) // 2
    add(0, half)
    steps = 0
    while engine.has_unfinished() or len(outputs) < len(requests):
        if steps == 7:
            add(half, len(requests))
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        steps += 1
    return outputs


def _engine(padded: bool, capture: EmulatedGraphCapture | None = None, **config: object) -> Engine:
    # The gathered path's graphs (its padded widths and workspace); the in-place kernels' are
    # tests/engine/test_triton_decode.py's.
    # No speculation: its verification steps are not decode-only, so they never take a graph.
    settings = {
        "kv_cache_memory": "160KiB",
        "max_num_seqs": 12,
        "max_num_batched_tokens": 64,
        "decode_attention": "gather",
        "speculative": "none",
    }
    engine = make_engine(load_model(MODEL), **{**settings, **config})
    if padded:
        engine.runner.enable_decode_graphs(12, engine.max_model_len, capture)
    return engine


def test_padded_decode_steps_give_the_eager_tokens_under_joins_chunks_and_preemption(ref):
    requests = _requests()
    eager_engine, padded_engine = _engine(False), _engine(True)
    eager, padded = _run(eager_engine, requests), _run(padded_engine, requests)
    graphs = padded_engine.runner.graphs
    assert graphs is not None and graphs.num_steps > 50  # most steps took the padded path
    assert padded_engine.stats.num_preemptions_total > 0  # the small pool preempted
    for i, (prompt, _) in enumerate(requests):
        assert_greedy_parity(ref, prompt, padded[str(i)], eager[str(i)])
    padded_engine.block_manager.check_integrity()


def test_emulated_graphs_give_the_eager_tokens_under_joins_chunks_and_preemption(ref):
    """Capture and replay as CUDA does them (tests/engine/graph_emulator.py): host values frozen
    at capture, no host sync inside, memory from before the capture kept alive. Mixed steps in
    between read more blocks than a graph's step, which once moved the workspace graphs write."""
    requests = _requests(2)
    capture = EmulatedGraphCapture()
    eager_engine, graphed_engine = _engine(False), _engine(True, capture)
    eager, graphed = _run(eager_engine, requests), _run(graphed_engine, requests)
    graphs = graphed_engine.runner.graphs
    assert graphs is not None and graphs.failed is None
    assert len(graphs.graphs) >= 4  # several (batch, width) pairs were captured
    assert sum(g.replays for g in capture.graphs) == graphs.num_steps > 50
    # Every graph's logits are rows of one shared buffer, not an allocation per graph.
    shared = {entry.logits.untyped_storage().data_ptr() for entry in graphs.graphs.values()}
    assert len(shared) == 1
    assert graphed_engine.stats.num_preemptions_total > 0
    for i, (prompt, _) in enumerate(requests):
        assert_greedy_parity(ref, prompt, graphed[str(i)], eager[str(i)])
    graphed_engine.block_manager.check_integrity()


def test_padding_rows_write_only_the_scratch_block_outside_the_pool():
    engine = _engine(True)
    graphs = engine.runner.graphs
    assert graphs is not None
    assert graphs.scratch_block == engine.view.kv_total_blocks == engine.kv_cache.num_blocks - 1
    engine.kv_cache._storage.fill_(7.0)  # a sentinel any write changes (token 0 embeds to 0)
    before = engine.kv_cache._storage.clone()
    engine.add_request("a", [9, 10, 11], SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("b", [12, 13], SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("c", [14], SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert graphs.num_steps > 0  # 3 decodes padded to 4: one padding row per step
    changed = (engine.kv_cache._storage != before).flatten(3).any(-1)  # [layers, 2, blocks]
    used = set(changed.nonzero()[:, 2].tolist())
    # The three sequences' blocks (the first three taken) and the scratch block, nothing else.
    assert used <= {0, 1, 2, graphs.scratch_block} and graphs.scratch_block in used


def test_steps_past_the_largest_bucket_or_the_read_budget_run_eagerly():
    engine = _engine(True)
    graphs = engine.runner.graphs
    assert graphs is not None
    assert graphs.fits(12, 40) and not graphs.fits(13, 40)
    graphs.max_read_bytes = 1  # no padded read fits: every step eager
    _run(engine, _requests()[:4])
    assert graphs.num_steps == 0


def test_enforce_eager_and_the_cpu_leave_graphs_off():
    assert _engine(False).runner.graphs is None  # CPU: eager unless asked
    assert make_engine(load_model(MODEL), enforce_eager=True).runner.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_give_the_eager_tokens_on_cuda():
    requests = _requests()
    loaded = load_model(MODEL, "cuda", torch.float32)
    settings = {"device": "cuda", "kv_cache_memory": "160KiB", "max_num_seqs": 12}
    eager = _run(make_engine(loaded, enforce_eager=True, **settings), requests)
    graphed_engine = make_engine(load_model(MODEL, "cuda", torch.float32), **settings)
    graphed = _run(graphed_engine, requests)
    graphs = graphed_engine.runner.graphs
    assert graphs is not None and graphs.failed is None and graphs.graphs
    ref = load_model(MODEL, "cuda", torch.float32)
    for i, (prompt, _) in enumerate(requests):
        assert_greedy_parity(ref, prompt, graphed[str(i)], eager[str(i)])
