"""The live batch view's snapshot, built from a real tiny-model engine, and its publisher."""

from __future__ import annotations

import re

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.models.model_loader import LoadedModel, load_model
from generation.sampling_params import SamplingParams
from protocol import Keys
from protocol.snapshot import PHASES, BatchSnapshot
from tests.engine.engine_helpers import make_engine
from worker.live_snapshot import SnapshotPublisher, build_snapshot, short_id
from worker.redis_io import EntryRef
from worker.request_book import TrackedRequest


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-random")


def test_phases_follow_the_batch_through_chunked_prefill_and_preemption(loaded):
    """A KV pool of 14 blocks of 4 tokens and a 16-token budget for 6 requests: seats go
    waiting -> prefill (chunked: computed < target) -> decode, and some are preempted."""
    engine = make_engine(
        loaded,
        block_size=4,
        kv_cache_memory=str(14 * 2048),  # tiny-random: 2 KiB of K/V per block of 4
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"req-{i}", list(range(10, 22)), params, priority=i % 2)
    seen: set[str] = set()
    partial_prefill = False
    while engine.has_unfinished():
        engine.step()
        snap = build_snapshot(engine, "w1", "tiny-random", waiting_seats=3)
        assert snap.running == engine.view.num_running and snap.waiting == engine.view.num_waiting
        assert len(snap.seats) == snap.running + min(3, snap.waiting)
        held, queued = snap.seats[: snap.running], snap.seats[snap.running :]
        assert {s.phase for s in held} <= {"prefill", "decode"}
        assert {s.phase for s in queued} <= {"waiting", "preempted"}
        for seat in snap.seats:
            assert re.fullmatch(r"[0-9a-f]{8}", seat.id)
            assert seat.max_tokens == 30 and 0 <= seat.done < 30
            assert seat.priority in (0, 1)
            partial_prefill |= seat.phase == "prefill" and 0 < seat.computed < seat.target
        assert 0 < snap.kv_total == 14 and 0 <= snap.kv_used <= 14
        assert snap.max_num_seqs == 4 and snap.limit and snap.step_ms > 0
        seen |= {s.phase for s in snap.seats}
    assert seen == {"prefill", "decode", "waiting", "preempted"}, seen
    assert partial_prefill, "no chunked prefill seen mid-way"
    assert engine.stats.num_preemptions_total > 0


def test_ids_are_short_hashes_unless_full_ids_and_the_snapshot_round_trips(loaded):
    engine = make_engine(loaded, max_num_seqs=2)
    engine.add_request("cmpl-abc", [5, 6, 7], SamplingParams(max_tokens=4, n=2, ignore_eos=True))
    engine.step()
    short = build_snapshot(engine, "w1", "tiny-random")
    assert [s.id for s in short.seats] == [short_id("cmpl-abc")] * len(short.seats)
    book = {"cmpl-abc": TrackedRequest(EntryRef("q", "1-0"), "replies", 0.0, key_id="team-a")}
    full = build_snapshot(engine, "w1", "tiny-random", full_ids=True, tracked=book)
    assert {s.id for s in full.seats} == {"cmpl-abc"}
    assert {s.key for s in full.seats} == {"team-a"} and {s.key for s in short.seats} == {None}
    again = BatchSnapshot.decode(full.encode())
    assert again.to_dict() == full.to_dict()
    assert all(s.phase in PHASES for s in again.seats)
    assert len(full.encode()) < 680


def test_the_snapshot_says_the_prefix_hit_rate_and_where_requests_waited(loaded):
    """Half the prompt tokens of two runs of one 32-token prompt (block 16) come from the
    cache: the second run's first block (its last must be computed to sample)."""
    engine = make_engine(loaded, block_size=16)
    for request_id in ("a", "b"):
        engine.add_request(request_id, list(range(5, 37)), SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
    reads = {"own": 3, "shared": 1, "wait_s": 0.02}
    snap = build_snapshot(engine, "w1", "tiny-random", reads=reads)
    assert snap.prefix == {
        "hit_rate": 0.25,
        "own": 3.0,
        "shared": 1.0,
        "stolen": 0.0,
        "wait_ms": 5.0,
    }
    assert BatchSnapshot.decode(snap.encode()).prefix == snap.prefix
    older = {k: v for k, v in snap.to_dict().items() if k != "prefix"}  # a worker before it
    assert BatchSnapshot.from_dict(older).prefix is None


def test_a_publish_failure_never_reaches_the_loop_and_backs_off(loaded, caplog):
    """Redis down (nothing listens on the port): maybe_publish returns quietly, logs once, and
    does not try again within the lease. (In the loop, an outage usually fails the iteration's
    earlier calls first, so the publisher is not even reached.)"""
    engine = make_engine(loaded)
    client = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    publisher = SnapshotPublisher(client, Keys("t"), "w1", "tiny-random", interval_s=0.0)
    publisher.maybe_publish(engine)
    publisher.maybe_publish(engine)  # backed off: no second attempt, no second warning
    assert [r.message for r in caplog.records] == ["live_view_unpublished error=ConnectionError"]


def test_a_seat_says_how_many_tokens_its_last_step_gave(loaded):
    """Decoding seats say 1 without speculation; with the target as its own draft, the steps
    that keep drafts give a seat several tokens, and the snapshot carries the count."""
    seen: dict[str, set[int]] = {}
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for name, config in (
        ("plain", {"speculative": "none"}),
        ("draft", {"speculative_model": "tiny-random"}),
    ):
        engine = make_engine(loaded, kv_cache_memory="16MiB", **config)
        engine.add_request("r", [5, 6, 7, 8, 9] * 4, params)
        seen[name] = set()
        while engine.has_unfinished():
            engine.step()
            snap = BatchSnapshot.decode(build_snapshot(engine, "w1", "tiny-random").encode())
            seen[name] |= {s.step_tokens for s in snap.seats if s.phase == "decode"}
    assert seen["plain"] == {1}
    assert max(seen["draft"]) > 1


def test_a_seat_names_the_lora_adapter_its_request_runs_under(tmp_path):
    """Two requests running together on a real engine, one under adapter "sql": its seats say
    "sql" through the snapshot's wire form, the base model's say None."""
    from engine.config import EngineConfig
    from engine.llm_engine import Engine
    from tests.lora_adapters import write_peft_adapter
    from tests.model_dirs import SMALL_LLAMA, write_random_llama

    base = write_random_llama(tmp_path / "base", seed=3, **SMALL_LLAMA)
    adapter = write_peft_adapter(base, tmp_path / "sql", rank=4, seed=1)
    config = EngineConfig.from_flat(
        model=str(base), kv_cache_memory="4MiB", lora_modules=(("sql", str(adapter)),)
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("tuned", [5, 6, 7], params, lora="sql")
    engine.add_request("plain", [8, 9, 10], params)
    engine.step()
    snap = BatchSnapshot.decode(build_snapshot(engine, "w1", "base", full_ids=True).encode())
    assert {(s.id, s.phase, s.adapter) for s in snap.seats} == {
        ("tuned", "decode", "sql"),
        ("plain", "decode", None),
    }
