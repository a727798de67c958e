"""The worker's prefix summary from a real tiny-model engine: what it sends as blocks are
computed and evicted, how much per step, and starting afresh."""

from __future__ import annotations

import pytest

from engine.models.model_loader import LoadedModel, load_model
from generation import SamplingParams
from generation.block_hash import prompt_block_hashes, summary_hash
from protocol.queue.placement import ADAPTERS_FIELD, BLOCK_SIZE_FIELD, ROOM_FIELD, WAITING_FIELD
from tests.engine.engine_helpers import make_engine
from worker.prefix_summary import PrefixSummary

BLOCK = 4
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-random")


def short(prompt: list[int]) -> list[bytes]:
    return [summary_hash(h) for h in prompt_block_hashes(prompt, BLOCK)]


def run(engine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, PARAMS)
    while engine.has_unfinished():
        engine.step()


def test_the_summary_follows_the_cache_a_step_at_a_time(loaded):
    """A first update resets the summary (a new pool) with the load; a computed prompt's full
    blocks are added once; blocks another prompt evicts are removed; nothing changed: None."""
    engine = make_engine(loaded, block_size=BLOCK, kv_cache_memory=str(12 * 2048))  # 12 blocks
    summary = PrefixSummary("key")
    first = summary.update(engine.view, room=3, waiting=0)
    assert first is not None and first.reset and first.added == [] and first.removed == []
    load = {ROOM_FIELD: 3, WAITING_FIELD: 0, BLOCK_SIZE_FIELD: BLOCK, ADAPTERS_FIELD: ""}
    assert first.load == load
    assert summary.update(engine.view, room=3, waiting=0) is None
    prompt = list(range(10, 30))  # 5 full blocks
    run(engine, "a", prompt)
    update = summary.update(engine.view, room=3, waiting=0)
    assert update is not None and not update.reset and update.load == {}
    assert sorted(update.added) == sorted(short(prompt)) and update.removed == []
    other = list(range(100, 144))  # 11 blocks: evicts what "a" left cached
    run(engine, "b", other)
    update = summary.update(engine.view, room=2, waiting=1)
    assert update is not None and update.load == {ROOM_FIELD: 2, WAITING_FIELD: 1}
    cached = {summary_hash(h) for h in engine.view.cached_block_hashes()}
    assert set(update.removed) == set(short(prompt)) - cached
    assert set(update.added) == cached - set(short(prompt)) and update.removed


def test_changes_beyond_the_step_s_budget_go_in_later_steps_and_a_restart_resends_all(loaded):
    engine = make_engine(loaded, block_size=BLOCK, kv_cache_memory=str(32 * 2048))
    summary = PrefixSummary("key", max_changes=3)
    summary.update(engine.view, room=1, waiting=0)
    prompt = list(range(10, 42))  # 8 full blocks
    run(engine, "a", prompt)
    sent = []
    for _ in range(3):  # 3 + 3 + 2
        update = summary.update(engine.view, room=1, waiting=0)
        assert update is not None and len(update.added) <= 3
        sent += update.added
    assert sent == short(prompt)  # in the order they were computed
    assert summary.update(engine.view, room=1, waiting=0) is None
    summary.restart()  # e.g. fenced: what Redis holds is not to be trusted
    update = summary.update(engine.view, room=1, waiting=0)
    assert update is not None and update.reset and len(update.added) == 3
    assert set(update.added) <= set(short(prompt)) and BLOCK_SIZE_FIELD in update.load


def test_the_resident_adapters_are_sent_when_they_change(loaded):
    """The engine's resident LoRA adapters ride in the summary (" a b ": LOOKUP's form), sent
    only when the set changes."""
    engine = make_engine(loaded, block_size=BLOCK)
    summary = PrefixSummary("key")
    first = summary.update(engine.view, room=1, waiting=0, adapters=["sql", "chat"])
    assert first is not None and first.load[ADAPTERS_FIELD] == " chat sql "
    assert summary.update(engine.view, room=1, waiting=0, adapters=["chat", "sql"]) is None
    update = summary.update(engine.view, room=1, waiting=0, adapters=["sql"])
    assert update is not None and update.load == {ADAPTERS_FIELD: " sql "}
