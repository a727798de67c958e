"""The CPU emulation of CUDA-graph capture (tests/engine/graph_emulator.py) refuses and reports
what a real capture and replay would get wrong, and replays what it should."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCacheSpec, PagedKVCache
from tests.engine.graph_emulator import EmulatedGraphCapture, GraphCaptureError, GraphMemoryFreed


def test_a_replay_recomputes_from_the_static_inputs_and_rewrites_the_output():
    x, w = torch.arange(4.0), torch.ones(4, 3)
    replay, out = EmulatedGraphCapture()(lambda: (x * 2 + 1) @ w)
    assert out.isnan().all()  # a capture computes nothing: only a replay fills the output
    replay()
    assert out.tolist() == [16.0] * 3
    x.fill_(3.0)  # new inputs, written into the same tensor
    w[:, 1] = 2.0
    replay()
    assert out.tolist() == [28.0, 56.0, 28.0]


def test_in_place_writes_and_views_of_static_memory_are_replayed():
    pool, slots, values = torch.zeros(6), torch.tensor([0, 2]), torch.tensor([1.0, 2.0])

    def step() -> torch.Tensor:
        pool.index_copy_(0, slots, values)
        return pool[:4].sum(0, keepdim=True)

    replay, out = EmulatedGraphCapture()(step)
    slots.copy_(torch.tensor([3, 5]))
    values.fill_(7.0)
    replay()
    assert pool.tolist() == [1.0, 0.0, 2.0, 7.0, 0.0, 7.0]
    assert out.tolist() == [10.0]


def test_host_values_are_frozen_at_capture_as_in_a_cuda_graph():
    x, scale = torch.ones(2), [2.0]
    replay, out = EmulatedGraphCapture()(lambda: x * scale[0])
    scale[0] = 5.0  # a Python value: the graph keeps the one it was captured with
    replay()
    assert out.tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "step",
    [
        lambda x: x * x.sum().item(),
        lambda x: x[x > 0],
        lambda x: x.nonzero(),
        lambda x: x + torch.tensor([1.0, 2.0, 3.0]),  # host data copied to the device
    ],
    ids=["item", "boolean index", "nonzero", "host tensor"],
)
def test_host_syncs_inside_the_capture_are_refused(step):
    x = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(GraphCaptureError):
        EmulatedGraphCapture()(lambda: step(x))


def test_memory_freed_after_the_capture_is_reported_on_replay():
    holder = {"buffer": torch.zeros(4)}
    x = torch.ones(4)

    def step() -> torch.Tensor:
        holder["buffer"].copy_(x)
        return holder["buffer"] * 2

    replay, _ = EmulatedGraphCapture()(step)
    replay()
    holder["buffer"] = torch.zeros(8)  # the old one is freed: the graph still writes it
    with pytest.raises(GraphMemoryFreed):
        replay()


def test_a_reserved_workspace_never_moves_and_larger_reads_get_their_own():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=2)
    cache = PagedKVCache(spec, num_blocks=32)
    cache._storage.copy_(torch.randn(cache._storage.shape))
    cache.reserve_workspace(4 * spec.read_bytes_per_block)  # reads of up to 4 blocks
    workspace = cache._workspace
    small = torch.tensor([3, 1])
    k, v = cache.read_blocks(0, small)
    assert k.untyped_storage().data_ptr() == workspace.untyped_storage().data_ptr()
    big = torch.arange(20)
    k, v = cache.read_blocks(1, big)  # past the reservation: a buffer of its own
    assert torch.equal(k, cache.key_cache[1][big]) and torch.equal(v, cache.value_cache[1][big])
    assert k.untyped_storage().data_ptr() != workspace.untyped_storage().data_ptr()
    assert cache._workspace is workspace
    cache.reserve_workspace(2 * spec.read_bytes_per_block)  # smaller: nothing to do
    with pytest.raises(ValueError, match="fixed"):
        cache.reserve_workspace(8 * spec.read_bytes_per_block)
