"""Earlier replies as a proposer: the n-gram index of finished outputs, its bound, how it joins
prompt lookup, and a policy that drafts from one request's reply for the next."""

from __future__ import annotations

import random

import pytest

from scheduler import (
    ContinuousBatching,
    KVBlockManager,
    SchedulerConfig,
    Sequence,
    SpeculativeConfig,
)
from scheduler.speculation import NgramProposer, OutputHistory
from scheduler.speculation.history import history_kind


def test_drafts_roll_out_the_most_frequent_follower_longest_context_first():
    history = OutputHistory(capacity=100, order=3, min_order=2)
    history.add([1, 2, 3, 4, 5, 6])
    history.add([9, 2, 3, 7])  # "2 3" then 7 once, then 4 once: 4 was seen first
    history.add([8, 1, 2, 3, 4, 5, 0])  # "1 2 3" -> 4 twice; "3 4 5" -> 6, 0: 6 was seen first
    assert history.propose([7, 1, 2, 3], 3) == ([4, 5, 6], 3)
    # Only "2 3" of the tail is known (order 2): its followers 4 (twice) and 7 (once).
    assert history.propose([5, 2, 3], 1) == ([4], 2)
    assert history.propose([5, 5, 2], 4) == ([], 0)  # "5 2" was never seen: nothing
    assert history.propose([1, 2, 3], 0) == ([], 0)


def test_a_tie_goes_to_the_follower_seen_first():
    history = OutputHistory(capacity=100, order=2, min_order=2)
    history.add([1, 2, 8])
    history.add([1, 2, 9])
    assert history.propose([1, 2], 1) == ([8], 2)
    history.add([1, 2, 9])
    assert history.propose([1, 2], 1) == ([9], 2)


def test_the_oldest_replies_leave_past_the_capacity_and_their_counts_with_them():
    rng = random.Random(0)
    replies = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(60)]
    history = OutputHistory(capacity=150, order=4, min_order=2)
    for reply in replies:
        history.add(reply)
        assert history.num_tokens <= 150
    # What is left is exactly a fresh index of the replies it still holds.
    fresh = OutputHistory(capacity=10**6, order=4, min_order=2)
    for reply in history.replies:
        fresh.add(reply)
    assert history.followers == fresh.followers
    assert history.num_tokens == sum(len(r) for r in history.replies) > 100
    assert list(history.replies) == [r for r in replies if len(r) > 2][-len(history.replies) :]


def test_a_reply_longer_than_the_capacity_keeps_its_end_and_capacity_0_keeps_nothing():
    history = OutputHistory(capacity=5, order=2, min_order=2)
    history.add(list(range(10)))
    assert history.num_tokens == 5 and history.propose([5, 6], 2) == ([7, 8], 2)
    assert history.propose([1, 2], 1) == ([], 0)
    off = OutputHistory(capacity=0)
    off.add(list(range(10)))
    assert off.num_tokens == 0 and not off.followers


def test_a_bad_history_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        OutputHistory(capacity=-1)
    with pytest.raises(ValueError, match="min_order"):
        OutputHistory(order=2, min_order=3)
    with pytest.raises(ValueError, match="history_tokens"):
        SpeculativeConfig("ngram", history_tokens=-1)


def test_a_long_own_match_beats_the_history_and_a_short_one_loses_to_it():
    history = OutputHistory(capacity=100, order=4, min_order=3)
    history.add([20, 21, 22, 40, 41, 42])
    proposer = NgramProposer(4, 2, history)
    # Its own "20 21 22" was followed by 30: a three-token own match wins.
    own = Sequence.create("a", [20, 21, 22, 30, 31, 20, 21, 22], 8)
    assert (proposer.propose(own, 2).tokens, proposer.propose(own, 2).kind) == ([30, 31], 3)
    # Only "21 22" of its own repeats (two tokens): the history's three-token context wins.
    short = Sequence.create("b", [21, 22, 50, 20, 21, 22], 8)
    proposal = proposer.propose(short, 2)
    assert (proposal.tokens, proposal.kind) == ([40, 41], history_kind(3))
    # Nothing in the history: its own short match still proposes.
    other = Sequence.create("c", [21, 22, 50, 60, 21, 22], 8)
    assert (proposer.propose(other, 1).tokens, proposer.propose(other, 1).kind) == ([50], 2)


def _policy(history_tokens: int) -> ContinuousBatching:
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, history_tokens=history_tokens)
    config = SchedulerConfig(max_num_batched_tokens=64, speculative=spec)
    return ContinuousBatching(config, KVBlockManager(64, 4))


def _run(policy: ContinuousBatching, seq: Sequence, reply: list[int]) -> list[int]:
    """`seq` to its end, the model answering `reply`: the drafts each step verified."""
    seq.speculation.enabled = True
    policy.add_request(seq)
    verified: list[int] = []
    while not seq.status.is_finished:
        plan = policy.schedule(0)
        (chunk,) = plan.chunks
        drafts = list(seq.speculation.draft_token_ids) if chunk.num_draft_tokens else []
        verified.append(len(drafts))
        at = seq.num_output_tokens
        kept = []
        for draft, truth in zip(drafts, reply[at:], strict=False):
            if draft != truth:
                break
            kept.append(draft)
        sampled = reply[at + len(kept)]
        policy.update(plan, {seq.seq_id: sampled}, accepted={seq.seq_id: kept})
        policy.kv.check_integrity()
    assert seq.output_token_ids == reply
    return verified


@pytest.mark.parametrize("history_tokens", [0, 1000])
def test_a_finished_reply_feeds_the_drafts_of_the_next_request(history_tokens: int):
    policy = _policy(history_tokens)
    reply = [100 + i for i in range(12)]  # nothing in it repeats: its own text proposes nothing
    assert not any(_run(policy, Sequence.create("first", [1, 2, 3], len(reply)), reply))
    again = _run(policy, Sequence.create("second", [7, 8, 9, 100, 101, 102], 9), reply[3:])
    if history_tokens:  # its prompt ends in the first reply's "100 101 102": the rest is drafted
        assert again == [0, 4, 2]  # the prefill, then every draft the room allows, all kept
        assert policy.speculator.odds.counts[(history_kind(4), 0)] == [2.0, 2.0]
        assert (
            policy.speculator.history is not None and policy.speculator.history.num_tokens == 12 + 9
        )
    else:
        assert not any(again) and policy.speculator.history is None
