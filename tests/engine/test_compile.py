"""`--compile`: the dense forward's layer halves through torch.compile (inductor) give the eager
forward's logits, with one graph for every layer and no recompilation as the batch changes, and
inductor's generated code lands in the cache directory (so a second start skips the compile)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from engine.attention.step_inputs import AttentionMetadata
from engine.config import EngineConfig
from engine.models.llama import LlamaForward
from engine.models.weight_sources import StateDictWeights
from engine.runner.model_runner import resolve_forward
from tests.engine.engine_helpers import make_engine
from tests.engine.test_paged_attention import BlockPool, make_cache, make_models, rand_tokens


def _logits(forward, cache, entries) -> torch.Tensor:
    meta = AttentionMetadata.build([(s, n, t) for _, s, n, t in entries], cache)
    meta.logits_indices = torch.arange(meta.num_tokens)
    ids = torch.tensor([tok for toks, s, n, _ in entries for tok in toks[s : s + n]])
    return forward(ids, None, meta, cache)


def test_compiled_layers_give_eager_logits_without_recompiling(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JITNEY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the process's count
    ref, _ = make_models("qwen3")  # per-head q/k norms: both optional branches traced
    weights = StateDictWeights(dict(ref.named_parameters()))
    eager = LlamaForward(ref.config, weights)
    compiled = LlamaForward(ref.config, weights, compiled=True)
    caches = {"eager": make_cache(ref.config), "compiled": make_cache(ref.config)}
    pool = BlockPool(64, seed=1)
    seqs = [(rand_tokens(24, seed=s), pool.take(6)) for s in (3, 4, 5)]
    # Prefill chunks of different sizes, then decode steps of 3, 2 and 1 sequences.
    steps = [[(0, 7), (0, 3), (0, 9)], [(7, 5), (3, 8), (9, 2)]]
    steps += [[(12 + i, 1), (11 + i, 1), (11 + i, 1)] for i in range(3)]
    steps += [[(15, 1), (14, 1)], [(16, 1)]]
    for step in steps:
        entries = [(toks, s, n, t) for (toks, t), (s, n) in zip(seqs, step, strict=False)]
        want = _logits(eager, caches["eager"], entries)
        got = _logits(compiled, caches["compiled"], entries)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Two functions, each at most twice (torch specializes a dimension of size 1): the layers
    # share their graphs and batch sizes do not recompile.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before <= 4
    assert any((tmp_path / "inductor").rglob("*.py")), "inductor's code was not cached"


def test_compile_is_for_the_dense_forward(loaded) -> None:
    """The quantized path and transformers' forward refuse --compile, saying why."""
    with pytest.raises(ValueError, match="--compile compiles Jitney's dense forward"):
        resolve_forward(loaded, "auto", "int8", compiled=True)
    with pytest.raises(ValueError, match="transformers' forward"):
        resolve_forward(loaded, "transformers", "none", compiled=True)
    assert EngineConfig().compile is False
    engine = make_engine(loaded, kv_cache_memory="16MiB")
    assert engine.view.forward_name == "jitney-none"
