"""Static and dynamic batching: a batch launches, runs to completion, nothing joins."""

from scheduler import StepLimit
from tests.factories import make_seq, run_step


def test_static_waits_for_a_full_batch(make_scheduler):
    """Three of four slots' worth waiting: nothing runs until the fourth arrives."""
    sched = make_scheduler("static", max_num_seqs=4)
    for i in range(3):
        sched.add_request(make_seq(f"r{i}"))
    for step in range(5):
        plan, _ = run_step(sched, now=step)
        assert plan.is_empty
    sched.add_request(make_seq("r3"))
    plan, _ = run_step(sched, now=5)
    assert list(plan.prefill_chunks) == ["r0", "r1", "r2", "r3"]


def test_static_holds_finished_sequences_until_the_batch_ends(make_scheduler):
    """A short request is returned with the longest one of its batch, not before."""
    sched = make_scheduler("static", max_num_seqs=2)
    sched.add_request(make_seq("short", max_tokens=1))
    sched.add_request(make_seq("long", max_tokens=4))
    sched.add_request(make_seq("next", max_tokens=1))
    released_at = {}
    for step in range(4):
        plan, released = run_step(sched, now=step)
        assert "next" not in plan.prefill_chunks
        released_at.update({seq.seq_id: step for seq in released})
    assert released_at == {"short": 3, "long": 3}
    assert [seq.seq_id for seq in sched.waiting] == ["next"]


def test_nothing_joins_a_running_batch(make_scheduler):
    """Free slots in a running batch stay empty; waiting requests wait for the next one."""
    sched = make_scheduler("static", max_num_seqs=2)
    sched.add_request(make_seq("a", max_tokens=1))
    sched.add_request(make_seq("b", max_tokens=5))
    run_step(sched)
    sched.add_request(make_seq("c"))
    sched.add_request(make_seq("d"))
    for step in range(1, 5):
        plan, _ = run_step(sched, now=step)
        assert [c.seq_id for c in plan.chunks] == ["b"]
        assert plan.limit is StepLimit.BATCH
    plan, _ = run_step(sched, now=5)
    assert list(plan.prefill_chunks) == ["c", "d"]


def test_flush_launches_a_partial_batch(make_scheduler):
    """Static with fewer requests than slots runs them once no more will come."""
    sched = make_scheduler("static", max_num_seqs=4)
    sched.add_request(make_seq("a", max_tokens=2))
    assert run_step(sched)[0].is_empty
    sched.flush()
    assert list(run_step(sched)[0].prefill_chunks) == ["a"]


def test_dynamic_launches_when_the_oldest_waited_long_enough(make_scheduler):
    """max_queue_delay after the oldest arrival, a partial batch goes."""
    sched = make_scheduler("dynamic", max_num_seqs=4, max_queue_delay=15)
    sched.add_request(make_seq("a", arrival=0))
    sched.add_request(make_seq("b", arrival=10))
    assert run_step(sched, now=14)[0].is_empty
    plan, _ = run_step(sched, now=15)
    assert list(plan.prefill_chunks) == ["a", "b"]


def test_dynamic_launches_at_once_when_full(make_scheduler):
    """A full batch does not wait for the delay."""
    sched = make_scheduler("dynamic", max_num_seqs=2, max_queue_delay=100)
    sched.add_request(make_seq("a"))
    sched.add_request(make_seq("b"))
    assert list(run_step(sched, now=0)[0].prefill_chunks) == ["a", "b"]


def test_static_batch_is_limited_by_kv_reservations(make_scheduler):
    """When the pool cannot hold a full batch's full lengths, the batch is what fits."""
    sched = make_scheduler("static", max_num_seqs=4, num_blocks=4, block_size=4)
    for i in range(4):
        sched.add_request(make_seq(f"r{i}", prompt_len=4, max_tokens=5))  # 2 blocks each
    plan, _ = run_step(sched)
    assert list(plan.prefill_chunks) == ["r0", "r1"]
    launched = []
    for step in range(1, 20):  # a memory-full batch is a full batch: no flush needed
        plan, _ = run_step(sched, now=step)
        assert not plan.preempted_seq_ids
        launched += list(plan.prefill_chunks)
    assert launched == ["r2", "r3"] and not sched.has_unfinished()


def test_abort_of_last_running_member_releases_the_held_ones(make_scheduler):
    """If the longest request is aborted, its finished batch-mates come back at the next step."""
    sched = make_scheduler("static", max_num_seqs=2)
    sched.add_request(make_seq("short", max_tokens=1))
    sched.add_request(make_seq("long", max_tokens=50))
    run_step(sched)
    assert sched.kv.num_used_blocks > 0
    sched.abort("long")
    assert sched.has_unfinished()  # "short" is still owed to its client
    plan, released = run_step(sched)
    assert [s.seq_id for s in released] == ["short"] and plan.is_empty
    assert not sched.has_unfinished() and sched.kv.num_used_blocks == 0
