"""research/kv_dtype.py: one user's decode timed per KV dtype, every (context, dtype) measured each
counted round, the ratios against the first dtype, and the idle pool check timed apart."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel, load_model
from research import kv_dtype


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-random")


def test_every_context_and_dtype_is_timed_each_round_and_tabled():
    timings = kv_dtype.run("tiny-random", ["float32", "float16"], [16, 40], 6, 2, "none", "64MiB")
    assert [(t.context, t.dtype) for t in timings] == [
        (16, "float32"),
        (16, "float16"),
        (40, "float32"),
        (40, "float16"),
    ]
    assert all(len(t.ms_per_token) == 2 and min(t.ms_per_token) > 0 for t in timings)
    table = kv_dtype.table(timings)
    assert "| 40 |" in table and "float32 / float16" in table and table.count("x |") == 2


def test_the_idle_pool_check_is_timed_apart_from_the_decode(loaded):
    """The step that ends the request checks the whole pool (O(blocks): a million-block pool takes
    tens of ms, which once counted as decode made 16-bit pools look slower on tiny-random); it
    happens inside the timed steps, and ms per token leaves it out."""
    engine = Engine(
        EngineConfig.from_flat(model="tiny-random", kv_cache_memory="1GiB", speculative="none"),
        loaded=loaded,
    )
    timed = kv_dtype.decode(engine, list(range(3, 43)), 16)
    assert timed.tokens == 15  # after the first
    assert 0 < timed.idle_check_s < timed.seconds
    assert timed.ms_per_token == (timed.seconds - timed.idle_check_s) * 1000 / 15


def test_a_context_longer_than_the_text_is_refused():
    with pytest.raises(ValueError, match="fewer than"):
        kv_dtype.run("tiny-random", ["float32"], [10**7], 4, 1)
