"""Continuous batching, step by step: add, schedule, fake output, update, assert."""

import pytest

from scheduler import InfeasibleRequestError, SequenceStatus, StepLimit
from tests.factories import make_seq, run_step


def test_admits_in_fifo_order_up_to_max_num_seqs(make_scheduler):
    """Three slots: the first three requests run, the fourth waits its turn."""
    sched = make_scheduler(max_num_seqs=3)
    for i in range(4):
        sched.add_request(make_seq(f"r{i}", prompt_len=4, max_tokens=2))
    plan, _ = run_step(sched)
    assert list(plan.prefill_chunks) == ["r0", "r1", "r2"]
    assert plan.limit is StepLimit.SEQS
    assert [s.seq_id for s in sched.waiting] == ["r3"]


def test_finished_leave_and_waiting_join_in_the_same_step(make_scheduler):
    """When r0 finishes, r2 takes its slot at the very next step."""
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_seq("r0", max_tokens=1))
    sched.add_request(make_seq("r1", max_tokens=3))
    sched.add_request(make_seq("r2", max_tokens=3))
    _, released = run_step(sched)
    assert [s.seq_id for s in released] == ["r0"]
    plan, _ = run_step(sched)
    assert plan.decode_seq_ids == ["r1"] and list(plan.prefill_chunks) == ["r2"]


def test_chunked_prefill_shares_the_budget_with_decodes(make_scheduler):
    """Decodes go first; a long prompt takes min(budget left, prompt left) per step."""
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4, num_blocks=64)
    sched.add_request(make_seq("short", prompt_len=4, max_tokens=10))
    run_step(sched)  # short: prefill 4, samples its first token
    sched.add_request(make_seq("long", prompt_len=25, max_tokens=2))
    chunks = []
    for _ in range(3):
        plan, _ = run_step(sched)
        assert plan.decode_seq_ids == ["short"]
        chunks.append(plan.prefill_chunks["long"])
    assert chunks == [9, 9, 7]
    assert sched.seqs["long"].num_output_tokens == 1  # sampled only when the prompt was done
    plan, _ = run_step(sched)
    assert sorted(plan.decode_seq_ids) == ["long", "short"]


def test_samples_only_when_the_chunk_reaches_the_end(make_scheduler):
    """A partial prefill chunk computes K/V but yields no token."""
    sched = make_scheduler(max_num_batched_tokens=5)
    sched.add_request(make_seq("a", prompt_len=8))
    plan, _ = run_step(sched)
    assert [(c.start, c.num_tokens, c.samples) for c in plan.chunks] == [(0, 5, False)]
    plan, _ = run_step(sched)
    assert [(c.start, c.num_tokens, c.samples) for c in plan.chunks] == [(5, 3, True)]


def test_newest_running_sequence_is_preempted_and_goes_first_in_line(make_scheduler):
    """Out of blocks, the most recently admitted sequence is evicted and requeued at the front."""
    # block_size 4: each prompt of 4 fills a block; every 4 decodes need another block.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    for name in ("old", "mid", "new", "late"):
        sched.add_request(make_seq(name, prompt_len=4, max_tokens=13))  # 16 tokens: whole pool
    run_step(sched)  # 4 prompts of one block each fill the pool
    assert len(sched.running) == 4
    plan, _ = run_step(sched)  # each decode needs a 2nd block: evict from the newest end
    assert plan.preempted_seq_ids == ["late", "new"]
    assert plan.decode_seq_ids == ["old", "mid"]
    assert [s.seq_id for s in sched.waiting] == ["new", "late"]  # admission order kept
    assert all(sched.seqs[s].status is SequenceStatus.PREEMPTED for s in ("new", "late"))
    assert sched.seqs["new"].num_computed_tokens == 0 and sched.stats.num_preemptions_total == 2
    assert sched.stats.num_preempted_tokens_total == 8  # both had their 4 prompt tokens computed


def test_no_admission_in_a_step_that_preempted(make_scheduler):
    """A step that evicted running work does not let new work in."""
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=4)
    sched.add_request(make_seq("a", prompt_len=4, max_tokens=9))
    sched.add_request(make_seq("b", prompt_len=4, max_tokens=9))
    run_step(sched)
    sched.add_request(make_seq("c", prompt_len=1, max_tokens=1))
    plan, _ = run_step(sched)  # a, b need 2nd blocks: 1 free -> b preempted
    assert plan.preempted_seq_ids == ["b"]
    assert [c.seq_id for c in plan.chunks] == ["a"]
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]


def test_preempted_sequence_recomputes_and_finishes_with_all_its_tokens(make_scheduler):
    """After recompute the sequence continues where it stopped and ends at max_tokens."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    sched.add_request(make_seq("a", prompt_len=4, max_tokens=7))
    sched.add_request(make_seq("b", prompt_len=4, max_tokens=7))
    released = []
    preempted_at = None
    for step in range(40):
        plan, done = run_step(sched, token=step + 1)  # distinct tokens show the order kept
        released += done
        if plan.preempted_seq_ids and preempted_at is None:
            assert plan.preempted_seq_ids == ["b"]
            preempted_at = step
            generated = list(sched.seqs["b"].output_token_ids)
        if not sched.has_unfinished():
            break
    assert preempted_at is not None
    b = next(s for s in released if s.seq_id == "b")
    assert b.output_token_ids[: len(generated)] == generated  # kept across the preemption
    assert len(b.output_token_ids) == 7 and b.status is SequenceStatus.FINISHED_LENGTH
    assert b.num_preemptions >= 1


def test_victim_already_scheduled_this_step_is_refunded(make_scheduler):
    """Preempting a sequence scheduled earlier in the step gives its tokens back."""
    sched = make_scheduler(
        num_blocks=3,
        block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        max_preemptions_per_seq=1,
    )
    sched.add_request(make_seq("a", prompt_len=2, max_tokens=5))
    sched.add_request(make_seq("b", prompt_len=2, max_tokens=5))
    run_step(sched)
    sched.seqs["b"].num_preemptions = 1  # b is capped: the victim must be "a"
    plan, _ = run_step(sched)  # a gets block 3; b cannot, a (scheduled) is evicted
    assert plan.preempted_seq_ids == ["a"]
    assert [c.seq_id for c in plan.chunks] == ["b"]
    assert plan.num_batched_tokens == 1


def test_reservation_mode_never_preempts(make_scheduler):
    """Reserving prompt + max_tokens at admission trades concurrency for zero preemption."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, reserve_full_length=True)
    for name in ("a", "b", "c"):
        sched.add_request(make_seq(name, prompt_len=4, max_tokens=5))  # 8 tokens = 2 blocks
    plan, _ = run_step(sched)
    assert list(plan.prefill_chunks) == ["a", "b"] and plan.limit is StepLimit.KV
    while sched.has_unfinished():
        plan, _ = run_step(sched)
        assert not plan.preempted_seq_ids
    assert sched.stats.num_preemptions_total == 0


def test_abort_frees_blocks_at_once_wherever_the_request_is(make_scheduler):
    """Aborting a running and a waiting request frees every block they held."""
    sched = make_scheduler(max_num_seqs=1, num_blocks=8)
    sched.add_request(make_seq("run", prompt_len=8, max_tokens=10))
    sched.add_request(make_seq("wait", prompt_len=8, max_tokens=10))
    run_step(sched)
    assert sched.kv.num_free_blocks == 6
    assert sched.abort("run").status is SequenceStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == 8
    assert sched.abort("wait").status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort("wait") is None  # idempotent
    assert not sched.has_unfinished()
    plan, _ = run_step(sched)
    assert plan.is_empty


def test_abort_while_the_step_runs_is_ignored_by_update(make_scheduler):
    """A result for a request aborted mid-step is dropped, not applied."""
    sched = make_scheduler()
    sched.add_request(make_seq("a", max_tokens=3))
    plan = sched.schedule(0)
    sched.abort("a")
    assert sched.update(plan, {"a": 5}) == []


def test_infeasible_request_is_rejected_with_numbers(make_scheduler):
    """A request larger than the whole pool is refused at once, never left to hang."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(InfeasibleRequestError, match=r"needs 19 tokens .* 5 blocks .* has 4"):
        sched.add_request(make_seq("big", prompt_len=10, max_tokens=10))
    ok = make_seq("ok", prompt_len=10, max_tokens=7)  # 16 tokens: exactly fits
    sched.add_request(ok)
    assert list(sched.seqs) == ["ok"] and [s.seq_id for s in sched.waiting] == ["ok"]
    for _ in range(7):  # admitted and run to its end in the 4 blocks
        run_step(sched)
    assert ok.status is SequenceStatus.FINISHED_LENGTH and ok.num_output_tokens == 7
    assert not sched.has_unfinished()


def test_stop_token_and_stop_string_finish_as_stop(make_scheduler):
    """A stop token id ends a sequence; so does the worker's stop-string verdict."""
    sched = make_scheduler()
    sched.add_request(make_seq("tok", max_tokens=10, stop_token_ids=(7,)))
    sched.add_request(make_seq("str", max_tokens=10))
    plan = sched.schedule(0)
    released = sched.update(plan, {"tok": 7, "str": 3}, stopped_seq_ids={"str"})
    assert {s.seq_id: s.status.finish_reason for s in released} == {"tok": "stop", "str": "stop"}


def test_prefix_hit_skips_cached_tokens(make_scheduler):
    """A request whose prompt prefix is cached prefills only the rest."""
    sched = make_scheduler(block_size=4)
    sched.add_request(make_seq("a", prompt_len=10, max_tokens=2, base=100))
    run_step(sched)
    sched.add_request(make_seq("b", prompt_len=11, max_tokens=2, base=100))
    plan, _ = run_step(sched)
    assert plan.prefill_chunks == {"b": 3}  # 8 tokens (2 blocks) came from the cache
    assert sched.seqs["b"].num_cached_tokens == 8
    assert sched.stats.num_prefix_hits_total == 8


def test_duplicate_ids_are_refused(make_scheduler):
    """Two live requests may not share an id."""
    sched = make_scheduler()
    sched.add_request(make_seq("a"))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_seq("a"))


def test_stats_describe_the_step(make_scheduler):
    """SchedulerStats carries running/waiting, batch size and tokens, KV use."""
    sched = make_scheduler(max_num_seqs=2, num_blocks=10, block_size=4)
    for i in range(3):
        sched.add_request(make_seq(f"r{i}", prompt_len=6))
    run_step(sched)
    s = sched.stats
    assert (s.num_running, s.num_waiting, s.batch_size, s.num_batched_tokens) == (2, 1, 2, 12)
    assert s.num_free_blocks == 6 and s.kv_usage == pytest.approx(0.4)
