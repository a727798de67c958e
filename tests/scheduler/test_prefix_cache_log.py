"""The prefix cache's change log (what a worker's summary sends) and the shared block hash."""

from __future__ import annotations

from generation.block_hash import hash_block, prompt_block_hashes
from scheduler import KVBlockManager
from scheduler.prefix_cache_log import PrefixCacheLog
from tests.factories import make_seq, run_step


def test_the_gateway_hashes_a_prompt_as_the_block_manager_does(make_scheduler) -> None:
    """One function: the hashes the block manager registers for a computed prompt are those
    `prompt_block_hashes` gives the gateway (full blocks only), chained from the first."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    seq = make_seq("a", prompt_len=10, max_tokens=2)
    sched.add_request(seq)
    run_step(sched)
    kv = sched.kv
    expected = prompt_block_hashes(seq.prompt_token_ids, 4)
    assert len(expected) == 2 and set(expected) == set(kv.cached_hashes())
    assert expected[1] == hash_block(expected[0], seq.prompt_token_ids[4:8])
    assert prompt_block_hashes(seq.prompt_token_ids, 4, max_blocks=1) == expected[:1]


def test_the_log_reports_what_entered_and_left_the_cache_once() -> None:
    """A new pool asks for a resync first; then each drain says what was registered and what
    was evicted since the last one, each hash as the cache holds it now."""
    kv = KVBlockManager(num_blocks=3, block_size=2)
    assert kv.drain_cache_changes().resync  # a new pool: the reader starts from scratch
    first = make_seq("a", prompt_len=5, max_tokens=1)  # 2 full blocks and one partial
    assert kv.allocate_slots(first, 5)
    first.num_computed_tokens = 5
    kv.commit_computed(first)
    changes = kv.drain_cache_changes()
    assert not changes.resync and set(changes.added) == set(kv.cached_hashes())
    assert len(changes.added) == 2 and changes.removed == []
    assert kv.drain_cache_changes() == type(changes)([], [], resync=False)
    kv.free(first)  # cached but evictable: still in the cache, nothing changed
    assert kv.drain_cache_changes().added == []
    other = make_seq("b", prompt_len=6, max_tokens=1)  # another prompt: no shared prefix
    assert kv.allocate_slots(other, 6)  # takes all 3 blocks: both cached ones are evicted
    changes = kv.drain_cache_changes()
    assert changes.added == [] and set(changes.removed) == set(
        prompt_block_hashes(first.prompt_token_ids, 2)
    )
    kv.check_integrity()


def test_an_undrained_log_stops_at_its_limit_and_asks_for_a_resync() -> None:
    """Nobody draining (an offline engine) costs a bounded set: past the limit the log
    forgets and the next drain says resync."""
    log = PrefixCacheLog(limit=3, overflowed=False)
    for i in range(3):
        log.record(bytes([i]))
    assert len(log.changed) == 3 and not log.overflowed
    log.record(b"x")
    assert log.overflowed and not log.changed
    log.record(b"y")  # ignored: the reader resyncs anyway
    assert not log.changed
    assert log.drain(lambda h: True).resync
    log.record(b"z")
    assert log.drain(lambda h: h == b"z").added == [b"z"]
