"""The dummy largest step that sizes the KV cache on a GPU (engine/memory_profile.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec
from engine.llm_engine import Engine
from engine.memory_profile import largest_step_layout, step_peak_bytes
from engine.models.forward import ModelForward
from engine.models.model_loader import LoadedModel, load_model
from engine.runner.model_runner import model_forward_for

CPU = torch.device("cpu")


def _spec(loaded: LoadedModel) -> KVCacheSpec:
    model = loaded.model
    return KVCacheSpec(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, model.dtype, 16)


def _forward(loaded: LoadedModel) -> ModelForward:
    return model_forward_for(loaded)


@pytest.mark.parametrize(("tokens", "seqs"), [(512, 64), (40, 4), (3, 8), (1, 1)])
def test_the_largest_step_has_every_token_and_one_logits_row_per_sequence(tokens, seqs):
    layout = largest_step_layout(tokens, seqs, 16)
    assert sum(n for _, n, _ in layout) == tokens
    assert len(layout) == min(tokens, seqs)
    blocks = [b for _, _, table in layout for b in table]
    assert blocks == list(range(len(blocks)))  # every sequence on blocks of its own
    assert all(len(table) * 16 >= n for _, n, table in layout)


def test_the_dummy_step_runs_on_the_cpu_and_reports_no_peak():
    """Off CUDA there are no allocator statistics, but the step still runs (its shapes, the
    engine's attention and the sampler's top-p path are exercised before any GPU sees them)."""
    loaded = load_model("tiny-random")
    assert step_peak_bytes(_forward(loaded), CPU, _spec(loaded), 512, 64) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_peak_is_measured_and_the_cache_takes_the_rest():
    loaded = load_model("tiny-random", "cuda")
    peak = step_peak_bytes(_forward(loaded), loaded.model.device, _spec(loaded), 2048, 256)
    assert peak is not None and 0 < peak < torch.cuda.get_device_properties(0).total_memory
    # A tenth of the card: at 0.9 of an H200, tiny-random's 512 bytes a token make 15 million
    # blocks, whose bookkeeping alone takes minutes to build (seen on a lent H200).
    config = EngineConfig(model="tiny-random", device="cuda", gpu_memory_utilization=0.1)
    engine = Engine(config, loaded=loaded)
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < engine.capacity.budget_bytes <= 0.1 * total
