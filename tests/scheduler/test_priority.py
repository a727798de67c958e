"""Priority scheduling (vLLM's: lower is more urgent), step by step, on every policy."""

import json

import pytest

from scheduler import SchedulerConfig, Sequence, SequenceStatus, StepLimit
from scheduler.simulator import load_trace, simulate
from scheduler.waiting_queue import WaitingQueue
from tests.factories import make_seq, run_step


def pseq(seq_id: str, priority: int, **kwargs: object) -> Sequence:
    seq = make_seq(seq_id, **kwargs)  # type: ignore[arg-type]
    seq.priority = priority
    return seq


def ids(seqs: object) -> list[str]:
    return [s.seq_id for s in seqs]  # type: ignore[attr-defined]


def run_to_end(sched, max_steps: int = 500) -> dict[str, Sequence]:  # type: ignore[no-untyped-def]
    released: dict[str, Sequence] = {}
    for step in range(max_steps):
        _, done = run_step(sched, now=step)
        released.update((s.seq_id, s) for s in done)
        if not sched.has_unfinished():
            return released
    raise AssertionError(f"unfinished after {max_steps} steps")


# ----- the waiting queue --------------------------------------------------------------------------
def test_waiting_queue_orders_by_priority_then_fifo():
    """Lower priority first; FIFO within one; appendleft goes to the front of its own level."""
    q = WaitingQueue()
    for name, p in [("a", 5), ("b", 1), ("c", 5), ("d", 1), ("e", 0)]:
        q.append(pseq(name, p))
    q.appendleft(pseq("back", 5))
    assert ids(q) == ["e", "b", "d", "back", "a", "c"] and len(q) == 6
    assert q.peek().seq_id == "e" and q.popleft().seq_id == "e"
    q.remove(next(s for s in q if s.seq_id == "b"))
    assert ids(q) == ["d", "back", "a", "c"]
    assert [q.popleft().seq_id for _ in range(4)] == ["d", "back", "a", "c"]
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.peek()
    with pytest.raises(ValueError):
        q.remove(pseq("x", 3))


def test_oldest_arrival_looks_at_every_level():
    q = WaitingQueue()
    q.append(pseq("urgent", 0, arrival=3.0))
    q.append(pseq("old", 9, arrival=1.0))
    assert q.peek().seq_id == "urgent" and q.oldest_arrival() == 1.0


# ----- continuous: admission ----------------------------------------------------------------------
def test_admission_by_priority_then_fifo(make_scheduler):
    """Two slots, one-token requests: each step admits the two most urgent, FIFO among equals."""
    sched = make_scheduler(max_num_seqs=2)
    for name, p in [("a", 5), ("b", 1), ("c", 5), ("d", 1), ("e", 0)]:
        sched.add_request(pseq(name, p, max_tokens=1))
    admitted = [list(run_step(sched, now=t)[0].prefill_chunks) for t in range(3)]
    assert admitted == [["e", "b"], ["d", "a"], ["c"]]


def urgent_arrives_when_slots_are_full(make_scheduler):  # type: ignore[no-untyped-def]
    """Two priority-9 sequences hold both slots and have decoded once."""
    sched = make_scheduler(max_num_seqs=2, num_blocks=64)
    for name in ("old", "new"):
        sched.add_request(pseq(name, 9, prompt_len=4, max_tokens=20))
    run_step(sched, now=0)
    run_step(sched, now=1)
    return sched


def test_urgent_request_preempts_the_newest_less_urgent_one_for_a_slot(make_scheduler):
    """Every slot held by priority 9: a priority-0 arrival evicts one and starts in the same step;
    the victim waits at the front of its level, recomputes later, and everything finishes."""
    sched = urgent_arrives_when_slots_are_full(make_scheduler)
    sched.add_request(pseq("later9", 9, max_tokens=2))
    sched.add_request(pseq("urgent", 0, prompt_len=4, max_tokens=5))
    plan, _ = run_step(sched, now=2)
    assert plan.preempted_seq_ids == ["new"]
    assert plan.decode_seq_ids == ["old"] and list(plan.prefill_chunks) == ["urgent"]
    assert sched.seqs["urgent"].first_scheduled_time == 2
    assert ids(sched.waiting) == ["new", "later9"]
    assert sched.stats.num_preemptions_total == 1
    released = run_to_end(sched)
    assert {k: s.num_output_tokens for k, s in released.items()} == {
        "old": 20,
        "new": 20,
        "urgent": 5,
        "later9": 2,
    }
    assert released["new"].num_preemptions == 1 and released["old"].num_preemptions == 0


def test_urgent_request_preempts_when_kv_is_short(make_scheduler):
    """The pool is full of priority-9 prompts: a priority-0 arrival evicts the newest one (its
    scheduled decode refunded) and is admitted in the same step."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    for name in ("a", "b"):
        sched.add_request(pseq(name, 9, prompt_len=6, max_tokens=3))  # 2 blocks each
    run_step(sched, now=0)
    assert sched.kv.num_free_blocks == 0
    sched.add_request(pseq("urgent", 0, prompt_len=4, max_tokens=2))
    plan, _ = run_step(sched, now=1)
    assert plan.preempted_seq_ids == ["b"] and plan.limit is StepLimit.KV
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("urgent", 4)]
    assert sched.seqs["b"].status is SequenceStatus.PREEMPTED
    released = run_to_end(sched)
    assert sorted(released) == ["a", "b", "urgent"]
    assert all(s.num_output_tokens == s.limits.max_tokens for s in released.values())


def test_a_victim_is_not_readmitted_in_the_step_that_evicted_it(make_scheduler):
    """After the urgent head is in, the victim (which would now fit a one-token chunk) waits."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=10)
    sched.add_request(pseq("a", 9, prompt_len=3, max_tokens=4))
    victim = pseq("v", 9, prompt_len=7, max_tokens=2)
    victim.uses_prefix_cache = False  # readmission would need one fresh block, not a revival
    sched.add_request(victim)
    run_step(sched, now=0)  # a: 1 block, v: 2 blocks, 1 free
    sched.add_request(pseq("urgent", 0, prompt_len=8, max_tokens=2))
    plan, _ = run_step(sched, now=1)
    assert plan.preempted_seq_ids == ["v"] and list(plan.prefill_chunks) == ["urgent"]
    assert sched.kv.num_free_blocks == 1 and plan.num_batched_tokens == 9  # room, budget left
    assert ids(sched.waiting) == ["v"] and plan.limit is StepLimit.KV


@pytest.mark.parametrize("running_priority", [0, 5])
@pytest.mark.parametrize("also_waiting", [None, 9])
def test_no_preemption_for_an_equal_or_less_urgent_request(
    make_scheduler, running_priority, also_waiting
):
    """Slots full of priority-0 (or 5) work: a priority-5 arrival just waits, as FIFO would
    (also when a less urgent request waits behind it)."""
    sched = make_scheduler(max_num_seqs=2)
    for name in ("x", "y"):
        sched.add_request(pseq(name, running_priority, max_tokens=3))
    run_step(sched)
    sched.add_request(pseq("late", 5, max_tokens=1))
    if also_waiting is not None:
        sched.add_request(pseq("behind", also_waiting, max_tokens=1))
    plan, _ = run_step(sched, now=1)
    assert not plan.preempted_seq_ids and plan.limit is StepLimit.SEQS
    assert ids(sched.waiting)[0] == "late"


def test_no_preemption_for_a_less_urgent_request_when_kv_is_short(make_scheduler):
    """The pool is full of priority-0 work: a priority-9 arrival waits for blocks."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    for name in ("a", "b"):
        sched.add_request(pseq(name, 0, prompt_len=6, max_tokens=3))
    run_step(sched)
    sched.add_request(pseq("low", 9, prompt_len=4, max_tokens=2))
    plan, _ = run_step(sched, now=1)
    assert not plan.preempted_seq_ids and plan.limit is StepLimit.KV
    assert plan.decode_seq_ids == ["a", "b"] and ids(sched.waiting) == ["low"]


def test_reservation_mode_never_preempts_for_priority(make_scheduler):
    """Reserving full length promises no preemption: an urgent request waits its turn at the
    head of the queue instead."""
    sched = make_scheduler(max_num_seqs=1, reserve_full_length=True)
    sched.add_request(pseq("low", 9, max_tokens=3))
    run_step(sched)
    sched.add_request(pseq("later", 9, max_tokens=1))
    sched.add_request(pseq("urgent", 0, max_tokens=1))
    plan, _ = run_step(sched, now=1)
    assert not plan.preempted_seq_ids and ids(sched.waiting) == ["urgent", "later"]


# ----- continuous: KV pressure while running sequences grow ---------------------------------------
def test_kv_pressure_preempts_the_least_urgent_newest_first(make_scheduler):
    """Out of blocks, priority 9 goes before priority 0, the newest first among equals."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    for name, p in [("a", 0), ("b", 9), ("c", 9), ("d", 0)]:
        sched.add_request(pseq(name, p, prompt_len=4, max_tokens=13))  # 16 tokens: whole pool
    run_step(sched)  # admitted a, d, b, c: the pool is full
    assert ids(sched.running) == ["a", "d", "b", "c"]
    plan, _ = run_step(sched, now=1)  # each decode needs a 2nd block
    assert plan.preempted_seq_ids == ["c", "b"] and plan.decode_seq_ids == ["a", "d"]
    assert ids(sched.waiting) == ["b", "c"]  # admission order kept within the level
    released = run_to_end(sched)
    assert all(s.num_output_tokens == 13 for s in released.values()) and len(released) == 4


def test_an_older_less_urgent_sequence_is_preempted_for_a_newer_urgent_one(make_scheduler):
    """The victim was scheduled earlier in the step: its decode is dropped and refunded."""
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_seqs=2)
    sched.add_request(pseq("low", 9, prompt_len=2, max_tokens=6))
    run_step(sched)
    sched.add_request(pseq("urgent", 0, prompt_len=4, max_tokens=5))
    run_step(sched, now=1)  # low decodes, urgent prefills: both blocks used
    plan, _ = run_step(sched, now=2)  # urgent needs a 2nd block: the older low goes
    assert plan.preempted_seq_ids == ["low"]
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks] == [("urgent", 1)]


def test_a_least_urgent_self_victim_lets_more_urgent_ones_after_it_grow(make_scheduler):
    """`low` cannot grow and is itself the least urgent: it goes, and the urgent sequence admitted
    after it still decodes in the same step."""
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_seqs=2)
    sched.add_request(pseq("low", 9, prompt_len=3, max_tokens=5))
    run_step(sched)
    sched.add_request(pseq("urgent", 0, prompt_len=3, max_tokens=5))
    run_step(sched, now=1)  # low decodes (4 tokens, 1 block), urgent prefills (1 block)
    plan, _ = run_step(sched, now=2)  # low needs a 2nd block: none
    assert plan.preempted_seq_ids == ["low"] and plan.decode_seq_ids == ["urgent"]
    assert plan.limit is StepLimit.KV


# ----- static and dynamic batching ----------------------------------------------------------------
def test_static_launches_the_most_urgent_first(make_scheduler):
    sched = make_scheduler("static", max_num_seqs=2)
    for name, p in [("a", 5), ("b", 5), ("c", 0)]:
        sched.add_request(pseq(name, p, max_tokens=1))
    plan, _ = run_step(sched)
    assert list(plan.prefill_chunks) == ["c", "a"] and ids(sched.waiting) == ["b"]


def test_dynamic_delay_counts_from_the_oldest_whatever_its_priority(make_scheduler):
    sched = make_scheduler("dynamic", max_num_seqs=4, max_queue_delay=5)
    sched.add_request(pseq("old", 9, arrival=0.0, max_tokens=1))
    sched.add_request(pseq("urgent", 0, arrival=3.0, max_tokens=1))
    assert run_step(sched, now=4)[0].is_empty
    plan, _ = run_step(sched, now=5)  # old has waited 5
    assert list(plan.prefill_chunks) == ["urgent", "old"]


# ----- the simulator ----------------------------------------------------------------------------
def test_simulator_traces_carry_priorities(tmp_path):
    """A trace request may name its priority: a late urgent one overtakes the queue."""
    requests = [
        {"id": f"bulk{i}", "arrival_s": 0, "prompt_len": 4, "output_len": 10, "priority": 5}
        for i in range(4)
    ]
    requests.append({"id": "urgent", "arrival_s": 2, "prompt_len": 4, "output_len": 3})
    requests.append({"id": "vip", "arrival_s": 2, "prompt_len": 4, "output_len": 3, "priority": -1})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"requests": requests}))
    trace = load_trace(path, step_seconds=1.0)
    assert [r.priority for r in trace] == [5, 5, 5, 5, 0, -1]
    result = simulate(trace, "continuous", SchedulerConfig(max_num_seqs=2), check_integrity=True)
    assert result.latencies["vip"] == 3 and result.latencies["urgent"] == 3
    assert result.num_preemptions == 2
