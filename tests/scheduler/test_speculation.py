"""Speculative decoding in the scheduler: prompt-lookup proposals, verification chunks, the
tokens an update keeps, and the rejected drafts' KV given back (integrity after every step)."""

from __future__ import annotations

import itertools

import pytest

from scheduler import (
    ContinuousBatching,
    KVBlockManager,
    SamplingLimits,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    SpeculativeConfig,
)
from scheduler.speculation import DraftOdds, NgramProposer, RowCost
from scheduler.speculation.ngram import is_resume_kind, resume_kind
from scheduler.speculation.odds import PROBE_EVERY
from scheduler.speculation.proposer import Proposal
from scheduler.speculation.row_cost import MIN_STEPS


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_tail():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    # The tail 1 2 3 last appeared at index 4: what followed it there comes next.
    assert NgramProposer(3, 2).lookup(tokens, 2) == [8, 7]
    assert NgramProposer(3, 2).lookup(tokens, 10) == [8, 7, 1, 2, 3]


def test_ngram_tries_the_longest_tail_first_and_gives_nothing_without_a_match():
    # Tail "5 6" matches at 0 (then 7); the longer tail "4 5 6" matches at 3 (then 1).
    tokens = [5, 6, 7, 4, 5, 6, 1, 4, 5, 6]
    assert NgramProposer(3, 2).lookup(tokens, 1) == [1]
    assert NgramProposer(2, 2).lookup(tokens, 1) == [1]  # "5 6" latest at 4, then 1
    assert NgramProposer(4, 2).lookup([1, 2, 3, 4], 3) == []
    assert NgramProposer(4, 2).lookup([1, 1], 3) == []  # a tail needs one earlier copy
    assert NgramProposer(4, 1).lookup([1, 2, 1], 3) == [2, 1]
    assert NgramProposer(3, 2).lookup(tokens, 0) == []


def test_a_copy_an_edit_interrupted_resumes_after_the_replaced_token():
    # "1 2 3 4 5 6 7" is being copied, but with 9 in place of 4: the tail "3 9" matches nowhere.
    tokens = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 9]
    proposal = NgramProposer(4, 2).match(tokens, 3)
    # "1 2 3" before the 9 last appeared at 0: the copy goes on after the 4 it replaced.
    assert (proposal.tokens, proposal.kind) == ([5, 6, 7], resume_kind(3))
    assert is_resume_kind(proposal.kind) and not is_resume_kind(3)
    # Without resuming, only the tail's own n-grams: none here.
    assert NgramProposer(4, 2, resume=False).match(tokens, 3).tokens == []
    assert NgramProposer(4, 2).lookups()[:3] == [(4, 0), (3, 0), (2, 0)]


def test_a_resumed_copy_comes_after_the_own_n_grams_and_before_single_tokens():
    # The tail's own "3 9" matched at 0 (then 4): it beats "1 2 3" resumed from 3 (then 6).
    own = [3, 9, 4, 1, 2, 3, 5, 6, 1, 2, 3, 9]
    proposal = NgramProposer(4, 1).match(own, 1)
    assert (proposal.tokens, proposal.kind) == ([4], 2)
    assert NgramProposer(4, 1).match([*own[:-1], 7], 1) == Proposal([6], resume_kind(3))
    # Only the single token 9 of the tail repeats (at 4, then 5): the resumed "1 2 3" wins.
    tokens = [1, 2, 3, 4, 9, 5, 0, 1, 2, 3, 9]
    assert NgramProposer(4, 1).match(tokens, 2).tokens == [9, 5]  # after 4, which 9 replaced
    assert NgramProposer(4, 1, resume=False).match(tokens, 2).tokens == [5, 0]
    assert NgramProposer(4, 1).lookups() == [(4, 0), (3, 0), (2, 0), (4, 1), (3, 1), (2, 1), (1, 0)]
    assert NgramProposer(2, 2, resume=False).lookups() == [(2, 0)]


def test_a_bad_speculative_config_is_refused():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="max_step_tokens"):
        SpeculativeConfig("ngram", max_step_tokens=1)


def _policy(num_blocks: int = 32, k: int = 4, max_step_tokens: int = 16) -> ContinuousBatching:
    spec = SpeculativeConfig("ngram", num_speculative_tokens=k, max_step_tokens=max_step_tokens)
    config = SchedulerConfig(max_num_batched_tokens=64, speculative=spec)
    return ContinuousBatching(config, KVBlockManager(num_blocks, 4))


def _repeating(seq_id: str, max_tokens: int = 20, stop: tuple[int, ...] = ()) -> Sequence:
    seq = Sequence.create(seq_id, [1, 2, 3, 4, 5, 1, 2, 3], max_tokens, stop_token_ids=stop)
    seq.speculation.enabled = True
    return seq


def _prefill_and_first_token(policy: ContinuousBatching, token: int) -> None:
    plan = policy.schedule(0)
    assert all(c.is_prefill for c in plan.chunks)
    policy.update(plan, {c.seq_id: token for c in plan.chunks})
    policy.kv.check_integrity()


def test_a_verification_keeps_the_accepted_drafts_and_gives_back_the_rejected_slots():
    policy = _policy()
    seq = _repeating("a")
    policy.add_request(seq)
    _prefill_and_first_token(policy, 4)  # ... 1 2 3 | 4: the tail "2 3 4" was followed by 5 1 2 3
    plan = policy.schedule(1)
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_draft_tokens) == (8, 5, 4)
    assert seq.speculation.draft_token_ids == [5, 1, 2, 3]
    assert policy.kv.blocks_for(13) == len(policy.kv.block_ids("a"))  # 8 + 1 + 4 slots
    # The model agreed with 5 and 1, then picked 9 where the draft said 2.
    policy.update(plan, {"a": 9}, accepted={"a": [5, 1]})
    policy.kv.check_integrity()
    assert seq.output_token_ids == [4, 5, 1, 9]
    assert seq.speculation.num_step_tokens == 3  # what the live view shows
    assert seq.num_computed_tokens == 11  # the fed 4 and the accepted 5 1 hold K/V
    assert seq.num_uncomputed_tokens == 1 and seq.speculation.draft_token_ids == []
    assert len(policy.kv.block_ids("a")) == policy.kv.blocks_for(11)  # 3 blocks, not 4
    stats = policy.stats
    assert (stats.num_draft_tokens_total, stats.num_accepted_tokens_total) == (4, 2)
    assert stats.num_verifications_total == 1
    # and the sequence's own totals (its final reply's usage)
    assert (
        seq.speculation.num_draft_tokens,
        seq.speculation.num_accepted_tokens,
        seq.speculation.num_verifications,
    ) == (4, 2, 1)


def test_drafts_never_pass_max_tokens_and_an_accepted_stop_token_ends_the_sequence():
    policy = _policy()
    short = _repeating("short", max_tokens=3)
    stopping = _repeating("stopping", stop=(1,))
    policy.add_request(short)
    policy.add_request(stopping)
    _prefill_and_first_token(policy, 4)
    plan = policy.schedule(1)
    drafts = {c.seq_id: c.num_draft_tokens for c in plan.chunks}
    assert drafts == {"short": 1, "stopping": 4}  # short: 1 output + 1 draft + 1 sampled = 3
    done = policy.update(
        plan, {"short": 7, "stopping": 7}, accepted={"short": [5], "stopping": [5, 1, 2]}
    )
    policy.kv.check_integrity()
    assert short.output_token_ids == [4, 5, 7] and short.status is SequenceStatus.FINISHED_LENGTH
    assert stopping.output_token_ids == [4, 5, 1]  # 1 is a stop token: 2 and 7 are not kept
    assert (short.speculation.num_step_tokens, stopping.speculation.num_step_tokens) == (2, 2)
    assert stopping.status is SequenceStatus.FINISHED_STOPPED
    assert set(done) == {short, stopping}
    assert policy.kv.num_used_blocks == 0


def test_drafts_stay_within_the_step_rows_and_only_for_allowed_sequences():
    policy = _policy(max_step_tokens=2)
    a, b = _repeating("a"), _repeating("b")
    policy.add_request(a)
    policy.add_request(b)
    _prefill_and_first_token(policy, 4)
    assert all(c.num_draft_tokens == 0 for c in policy.schedule(1).chunks)  # 2 rows already

    policy = _policy(max_step_tokens=5)
    a, b = _repeating("a"), _repeating("b")
    policy.add_request(a)
    policy.add_request(b)
    _prefill_and_first_token(policy, 4)
    plan = policy.schedule(1)
    # a takes 3 drafts (a's 4 rows + b's 1 = 5), b none: the step holds 5 rows.
    assert [c.num_draft_tokens for c in plan.chunks] == [3, 0]
    assert plan.num_batched_tokens == 5

    policy = _policy()
    plain = _repeating("plain")
    plain.speculation.enabled = False
    policy.add_request(plain)
    _prefill_and_first_token(policy, 4)
    assert policy.schedule(1).chunks[0].num_draft_tokens == 0


def test_drafts_take_no_block_that_a_running_sequence_needs_this_step():
    policy = _policy(num_blocks=6)
    a, b = _repeating("a", max_tokens=10), _repeating("b", max_tokens=10)
    policy.add_request(a)
    policy.add_request(b)
    _prefill_and_first_token(policy, 4)  # 2 + 2 blocks of 4 hold both prompts; 2 free
    # a's 4 drafts would take both free blocks, and b's next token, needing one, would preempt.
    plan = policy.schedule(1)
    assert not plan.preempted_seq_ids
    assert [c.num_draft_tokens for c in plan.chunks] == [0, 0]
    policy.update(plan, {c.seq_id: 5 for c in plan.chunks})
    policy.kv.check_integrity()
    assert policy.kv.num_free_blocks == 0
    assert a.speculation.num_step_tokens == b.speculation.num_step_tokens == 1  # plain decodes


def test_a_trimmed_allocation_is_a_new_block_list():
    """The model runner keys its device copy of a table on the list's identity: a list that
    shrank and grew back to its old length must not look unchanged."""
    kv = KVBlockManager(8, 4)
    seq = Sequence.create("a", [1, 2, 3, 4, 5], 20)
    assert kv.allocate_slots(seq, 5 + 7)  # 12 slots: 3 blocks
    before = kv.block_ids("a")
    assert kv.trim(seq, 6) == 1
    assert kv.block_ids("a") is not before and len(kv.block_ids("a")) == 2
    assert kv.trim(seq, 6) == 0
    kv.check_integrity()


def test_num_drafts_is_what_one_decoding_sequence_may_verify_in_a_step():
    """What a model proposer computes before the plan, per sequence: within k, the step's
    rows and max_tokens."""
    spec = SpeculativeConfig("draft", num_speculative_tokens=4, max_step_tokens=5)
    seq = _repeating("a", max_tokens=4)
    assert spec.num_drafts(seq, 1) == 0  # no output yet: its prompt is still to compute
    seq.output_token_ids, seq.num_computed_tokens = [4], 8
    assert spec.num_drafts(seq, 1) == 2  # 1 output + 2 drafts + the sampled token = 4
    seq.limits = SamplingLimits(20)
    assert [spec.num_drafts(seq, rows) for rows in (1, 3, 5)] == [4, 2, 0]
    seq.speculation.enabled = False
    assert spec.num_drafts(seq, 1) == 0


def test_drafts_that_keep_failing_stop_being_verified_but_for_a_probe_now_and_then():
    """Every token here is one of the prompt's 1..5, so a one-token lookup always finds drafts;
    the model refuses them all. Once the measured odds of a first draft fall below what its row
    costs, the sequence decodes plainly, but for one draft every PROBE_EVERY proposals; a kept
    draft raises the odds again."""
    spec = SpeculativeConfig(
        "ngram", 4, prompt_lookup_max=1, prompt_lookup_min=1, draft_row_cost=0.25
    )
    config = SchedulerConfig(max_num_batched_tokens=64, speculative=spec)
    policy = ContinuousBatching(config, KVBlockManager(256, 4))
    seq = _repeating("a", max_tokens=400)

    def next_in_cycle() -> int:
        return seq.token_ids(seq.num_tokens - 1, seq.num_tokens)[0] % 5 + 1

    def refused() -> int:  # a token of the cycle, not the first draft
        return seq.speculation.draft_token_ids[0] % 5 + 1

    policy.add_request(seq)
    _prefill_and_first_token(policy, 4)
    drafts = []
    for _ in range(60):
        plan = policy.schedule(1)
        drafts.append(plan.chunks[0].num_draft_tokens)
        policy.update(plan, {"a": refused() if drafts[-1] else next_in_cycle()}, accepted={})
        policy.kv.check_integrity()
    kind = seq.speculation.draft_kind
    assert kind == 1  # a one-token tail's proposals
    # A miss is counted only at the first draft: the later ones' odds are untouched.
    misses = sum(1 for k in drafts if k)
    assert (
        policy.speculator.odds.counts[(kind, 0)] == [0, misses]
        and (kind, 1) not in policy.speculator.odds.counts
    )
    # Its own misses pull its odds below 0.25 after 4 (the engine's alone would take 12);
    # then one draft every PROBE_EVERY proposals.
    tried = [n for n, k in enumerate(drafts) if k]
    assert tried[:4] == [0, 1, 2, 3] and drafts[0] == 4 and not drafts[4]
    assert [b - a for a, b in itertools.pairwise(tried[3:])] == [PROBE_EVERY] * 3
    assert all(drafts[n] == 1 for n in tried[4:])
    # Kept drafts raise the first draft's odds back over the row's cost (after 7 misses, 2 kept
    # ones: 0.29), then the second's too (3 kept: 0.35 x 0.8), and the drafts grow.
    kept_probes = 0
    while (k := (plan := policy.schedule(1)).chunks[0].num_draft_tokens) < 2:
        if k:
            kept_probes += 1
            after = seq.speculation.draft_token_ids[-1] % 5 + 1
            policy.update(plan, {"a": after}, accepted={"a": seq.speculation.draft_token_ids})
        else:
            policy.update(plan, {"a": next_in_cycle()})
        policy.kv.check_integrity()
    assert misses == 7 and kept_probes == 3


def test_the_odds_count_each_draft_given_those_before_it_and_forget_slowly():
    odds = DraftOdds()
    assert odds.chance(2, 0) == odds.chance(7, 30) == 0.8  # the prior, for every kind
    odds.record(2, num_verified=5, num_kept=2)  # drafts 0, 1 kept, 2 refused, 3-4 never judged
    assert odds.counts == {(2, 0): [1, 1], (2, 1): [1, 1], (2, 2): [0, 1]}
    odds.record(2, num_verified=2, num_kept=2)  # all kept: the token after is the model's own
    assert odds.counts[(2, 1)] == [2, 2] and (2, 2) in odds.counts
    assert odds.chance(4, 0) == 0.8  # kinds apart: a 4-token tail's odds are its own
    for _ in range(1000):
        odds.record(1, num_verified=1, num_kept=0)
    kept, tried = odds.counts[(1, 0)]
    assert kept == 0 and tried < 256  # halved past the window: recent verifications weigh most
    assert odds.chance(1, 0) < 0.05


def test_a_sequence_s_own_verifications_move_its_odds_away_from_the_engine_s():
    odds, quoting, rambling = DraftOdds(), {}, {}
    for _ in range(20):
        odds.record(4, num_verified=3, num_kept=3, own=quoting)
        odds.record(4, num_verified=3, num_kept=0, own=rambling)
    engine = odds.chance(4, 0)  # half kept, over both
    assert odds.chance(4, 0, rambling) < engine / 2 < engine < odds.chance(4, 0, quoting)
    assert rambling[(4, 0)][1] < 16  # halved sooner than the engine's: its text now is what counts
    assert odds.chance(4, 1, rambling) == odds.chance(4, 1)  # never judged there: the engine's
    assert odds.paying(4, 7, 0.25, rambling) == 0 < odds.paying(4, 7, 0.25, quoting)


def test_the_drafts_that_pay_are_those_whose_odds_clear_the_break_even():
    odds = DraftOdds()  # 0.8 a position: 0.8, 0.64, 0.51, 0.41, 0.33, 0.26, 0.21
    assert [odds.paying(3, 7, b) for b in (0.0, 0.2, 0.3, 0.5, 0.9)] == [7, 7, 5, 3, 0]
    spec = SpeculativeConfig("ngram", draft_row_cost=0.1)
    assert spec.break_even(1) == pytest.approx(0.1)  # alone: a draft kept 1 time in 10 pays
    evens = [spec.break_even(b) for b in (1, 2, 4, 8)]
    assert evens == sorted(evens) and evens[-1] == pytest.approx(0.8 / 1.7)
    assert SpeculativeConfig("ngram", draft_row_cost=0.0).break_even(8) == 0.0
    with pytest.raises(ValueError, match="draft_row_cost"):
        SpeculativeConfig("ngram", draft_row_cost=1.5)
    # In a fuller batch the same proposal is cut shorter.
    alone, crowded = odds.paying(3, 7, spec.break_even(1)), odds.paying(3, 7, spec.break_even(6))
    assert alone == 7 and crowded < alone


def _steps(cost: RowCost, per_row_s: float, one_row_s: float, rows: list[int], n: int) -> None:
    """n decode steps at each row count, each taking one_row_s + per_row_s a row past one."""
    for _ in range(n):
        for r in rows:
            cost.observe(r, one_row_s + per_row_s * (r - 1))


def test_a_row_is_priced_by_the_line_through_the_steps_it_saw():
    cost = RowCost(0.11, measured=True)
    _steps(cost, 0.0015, 0.005, [1], 40)
    assert cost.cost == 0.11  # one row count says nothing about another row
    _steps(cost, 0.0015, 0.005, [8], MIN_STEPS - 1)
    assert cost.cost == 0.11  # nor does a count seen too few times
    _steps(cost, 0.0015, 0.005, [4, 8], 1)
    assert cost.cost == pytest.approx(0.3)  # 1.5 ms a row on a 5 ms one-row step
    # The machine slows and rows get dearer: the price follows within a few windows.
    _steps(cost, 0.003, 0.006, [1, 4, 8], 200)
    assert cost.cost == pytest.approx(0.5, abs=0.01)


def test_a_stalled_step_barely_moves_the_price_and_a_fixed_price_never_moves():
    cost = RowCost(0.2, measured=True)
    _steps(cost, 0.001, 0.005, [1, 2, 6], 40)
    assert cost.cost == pytest.approx(0.2)
    cost.observe(1, 5.0)  # a thousand times a one-row step: counted as three
    assert 0.18 < cost.cost < 0.2
    # A batch past the row cap (the batched kernels, never speculating) is not counted.
    before = cost.cost
    _steps(cost, 0.0001, 0.005, [32, 64], 40)
    assert cost.cost == before and set(cost.means) == {1, 2, 6}
    fixed = RowCost(0.11)
    _steps(fixed, 0.002, 0.005, [1, 8], 40)
    assert fixed.cost == 0.11 and not fixed.means
    # Steps that cost less with more rows (noise, a warming cache) price a row at nothing,
    # never below.
    falling = RowCost(0.2, measured=True)
    _steps(falling, -0.0001, 0.005, [1, 8], 40)
    assert falling.cost == 0.0
