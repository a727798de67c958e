"""What a policy speculates with, and the one place that decides who proposes drafts.

A `Speculator` is a policy's speculative decoding: its settings, who proposes drafts (or
nobody), the measured odds that a kind of draft is kept (odds.py), what a draft row costs a step
here (row_cost.py) and the finished replies that prompt lookup also reads (history.py). The
policy is given it when it is built (`make_policy`); nothing replaces its parts afterwards.

`speculator_for` builds it from the settings and what the engine has:
- method "none": nobody proposes;
- "ngram": prompt lookup over the sequence's own text (ngram.py), a caller's predicted reply
  first where the request has one (prediction.py), earlier replies where `history_tokens` keeps
  them;
- "draft": the engine's draft model (engine/draft_model.py), which computes its proposals in one
  batched pass before each plan, reading this speculator's odds and row cost as it does.
`guard`, where given, sees every proposal before the plan does (the engine's cuts the drafts a
request's grammar refuses: engine/speculative.py).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from scheduler.plan import SchedulerStats
from scheduler.sequence import Sequence, SpeculationState
from scheduler.speculation.history import OutputHistory, is_history_kind
from scheduler.speculation.ngram import NgramProposer
from scheduler.speculation.odds import DraftOdds
from scheduler.speculation.prediction import is_prediction_kind
from scheduler.speculation.proposer import Proposal, Proposer, SpeculativeConfig
from scheduler.speculation.row_cost import RowCost, break_even


@dataclass(slots=True)
class Speculator:
    """One policy's speculative decoding; built by `speculator_for`."""

    config: SpeculativeConfig
    # Who proposes draft tokens; None: nobody (every decode is plain).
    proposer: Proposer | None = None
    # Finished replies' n-grams, which prompt lookup also proposes from (None: not kept).
    history: OutputHistory | None = None
    # How often each kind of proposal's drafts are kept: how many of them a step verifies.
    odds: DraftOdds = field(default_factory=DraftOdds)
    # What a draft row costs a step here, against which the odds must pay (the engine reports
    # its steps when it measures it).
    row_cost: RowCost = field(init=False)

    def __post_init__(self) -> None:
        spec = self.config
        self.row_cost = RowCost(spec.draft_row_cost, spec.measure_row_cost, spec.max_step_tokens)

    def break_even(self, batch: int) -> float:
        """The chance of being kept at which a draft pays for its row in a step decoding `batch`
        sequences, at the row's current price."""
        return break_even(self.row_cost.cost, batch)

    def drafts(self, seq: Sequence, max_tokens: int, batch: int) -> Proposal:
        """Up to `max_tokens` of the proposer's drafts for `seq`: those whose odds pay for their
        rows in a step decoding `batch` sequences (now and then one that does not, as a probe:
        odds.py); no tokens when none is worth it."""
        assert self.proposer is not None
        proposal = self.proposer.propose(seq, max_tokens)
        own = seq.speculation.draft_counts
        worth = self.odds.worth(proposal.kind, len(proposal), self.break_even(batch), own)
        return Proposal(proposal.tokens[:worth], proposal.kind)

    def record(
        self, state: SpeculationState, num_drafts: int, num_kept: int, stats: SchedulerStats
    ) -> None:
        """A verification of `num_drafts` drafts kept `num_kept`: the odds of their kind, the
        sequence's totals and the scheduler's counters learn it."""
        kind = state.draft_kind
        self.odds.record(kind, num_drafts, num_kept, state.draft_counts)
        state.verified(num_drafts, num_kept)
        stats.num_draft_tokens_total += num_drafts
        stats.num_accepted_tokens_total += num_kept
        stats.num_verifications_total += 1
        if is_history_kind(kind):
            stats.num_history_draft_tokens_total += num_drafts
            stats.num_history_accepted_tokens_total += num_kept
        elif is_prediction_kind(kind):
            stats.num_prediction_draft_tokens_total += num_drafts
            stats.num_prediction_accepted_tokens_total += num_kept

    def finished(self, output_token_ids: SequenceABC[int]) -> None:
        """A sequence ended with these output tokens (the history learns them)."""
        if self.history is not None:
            self.history.add(output_token_ids)


def speculator_for(
    config: SpeculativeConfig,
    draft_model: Proposer | None = None,
    guard: Callable[[Proposer], Proposer] | None = None,
) -> Speculator:
    """A policy's speculation under `config`; `draft_model`: the engine's, which method "draft"
    needs and no other takes; `guard`: what wraps whoever proposes (the engine's grammar check)."""
    if (config.method == "draft") != (draft_model is not None):
        raise ValueError(
            "speculative method draft needs the engine's draft model"
            if draft_model is None
            else f"a draft model proposes under method draft, not {config.method!r}"
        )
    history = None
    proposer: Proposer | None = draft_model
    if config.method == "ngram":
        if config.history_tokens:
            history = OutputHistory(config.history_tokens)
        proposer = NgramProposer(
            config.prompt_lookup_max,
            config.prompt_lookup_min,
            history,
            config.prompt_lookup_resume,
        )
    if proposer is not None and guard is not None:
        proposer = guard(proposer)
    return Speculator(config, proposer, history)
