"""The speculation seam: `speculator_for` alone decides who proposes drafts, a policy speculates
with the Speculator it was built with, and a verification's result lands in one place."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler import (
    ContinuousBatching,
    KVBlockManager,
    SchedulerConfig,
    Sequence,
    SpeculativeConfig,
    make_policy,
)
from scheduler.plan import SchedulerStats
from scheduler.sequence import SpeculationState
from scheduler.speculation import NgramProposer, Proposal, Proposer, speculator_for
from scheduler.speculation.history import history_kind
from scheduler.speculation.prediction import prediction_kind


@dataclass(slots=True)
class FirstOnly:
    """A guard: only the first of `inner`'s drafts reaches the plan."""

    inner: Proposer

    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        proposal = self.inner.propose(seq, max_tokens)
        return Proposal(proposal.tokens[:1], proposal.kind)


def test_the_method_decides_who_proposes():
    assert speculator_for(SpeculativeConfig("none")).proposer is None
    ngram = speculator_for(SpeculativeConfig("ngram", prompt_lookup_max=3, history_tokens=0))
    assert isinstance(ngram.proposer, NgramProposer) and ngram.history is None
    assert (ngram.proposer.prompt_lookup_max, ngram.proposer.history) == (3, None)
    remembering = speculator_for(SpeculativeConfig("ngram", history_tokens=100))
    assert remembering.history is not None and remembering.history.capacity == 100
    assert remembering.proposer.history is remembering.history  # type: ignore[union-attr]
    model = NgramProposer(2, 1)  # any Proposer stands in for the engine's draft model
    drafting = speculator_for(SpeculativeConfig("draft"), model)
    assert drafting.proposer is model and drafting.history is None


def test_a_draft_model_goes_with_method_draft_only():
    with pytest.raises(ValueError, match="method draft needs the engine's draft model"):
        speculator_for(SpeculativeConfig("draft"))
    with pytest.raises(ValueError, match="proposes under method draft, not 'ngram'"):
        speculator_for(SpeculativeConfig("ngram"), NgramProposer())


def test_the_guard_wraps_whoever_proposes_and_the_policy_plans_what_it_lets_through():
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, max_step_tokens=16)
    speculator = speculator_for(spec, guard=FirstOnly)
    assert isinstance(speculator.proposer, FirstOnly)
    assert speculator_for(SpeculativeConfig("none"), guard=FirstOnly).proposer is None
    config = SchedulerConfig(max_num_batched_tokens=64, speculative=spec)
    policy = make_policy("continuous", config, KVBlockManager(32, 4), speculator)
    assert policy.speculator is speculator
    seq = Sequence.create("a", [1, 2, 3, 4, 5, 1, 2, 3], 20)
    seq.speculation.enabled = True
    policy.add_request(seq)
    plan = policy.schedule(0)
    policy.update(plan, {"a": 4})  # ... 1 2 3 | 4: a lookup would propose 5 1 2 3
    (chunk,) = policy.schedule(1).chunks
    assert chunk.num_draft_tokens == 1 and seq.speculation.draft_token_ids == [5]


def test_a_policy_refuses_a_speculator_built_for_other_settings():
    config = SchedulerConfig(speculative=SpeculativeConfig("ngram"))
    other = speculator_for(SpeculativeConfig("ngram", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="other speculative settings"):
        ContinuousBatching(config, KVBlockManager(8, 4), other)
    # Without one, a policy speculates as its settings say, with no engine.
    assert isinstance(
        ContinuousBatching(config, KVBlockManager(8, 4)).speculator.proposer, NgramProposer
    )


@pytest.mark.parametrize(
    ("kind", "history", "prediction"),
    [(2, (0, 0), (0, 0)), (history_kind(4), (3, 1), (0, 0)), (prediction_kind(), (0, 0), (3, 1))],
)
def test_a_verification_is_recorded_once_for_the_odds_the_sequence_and_the_counters(
    kind: int, history: tuple[int, int], prediction: tuple[int, int]
):
    speculator = speculator_for(SpeculativeConfig("ngram"))
    state, stats = SpeculationState(draft_token_ids=[7, 8, 9], draft_kind=kind), SchedulerStats()
    speculator.record(state, 3, 1, stats)
    assert state.draft_token_ids == []
    assert (state.num_draft_tokens, state.num_accepted_tokens, state.num_verifications) == (3, 1, 1)
    assert speculator.odds.counts[(kind, 0)] == [1, 1] and state.draft_counts[(kind, 1)] == [0, 1]
    assert (stats.num_draft_tokens_total, stats.num_accepted_tokens_total) == (3, 1)
    assert stats.num_verifications_total == 1
    assert (
        stats.num_history_draft_tokens_total,
        stats.num_history_accepted_tokens_total,
    ) == history
    assert (
        stats.num_prediction_draft_tokens_total,
        stats.num_prediction_accepted_tokens_total,
    ) == prediction
