"""Speculative decoding, the engine's side: the drafts a grammar allows, and the verification.

A verifying sequence's chunk is its last token and its k drafts (scheduler/speculation/). The
forward returns logits for all k + 1 positions: the chunk's first k as extra rows after the
sampling rows (the same mechanism as prompt log-probs), the last as its sampling row. Position j
(0..k) is picked exactly as plain decoding would pick the sequence's next token had drafts
0..j-1 been its output: penalties, bias and min_tokens over that output, its grammar's mask after
those tokens, the seeded draw of output index n + j, and its log-probs when asked. Draft j is kept
while it equals the pick at position j; the first pick that differs (or the pick after the last
draft) is the step's sampled token. So every kind of row speculates: what a position's pick reads
is the tokens before it, and those are the same tokens plain decoding would have had there.

For a sampled row this is rejection sampling. A draft is a single token, not a distribution
(prompt lookup copies one; a draft model proposes its greedy pick: a point mass), so keeping it
with probability p(draft) and otherwise drawing from p without it is the same as drawing from p
and keeping the draft when the draw is it, position after position. Every token is the model's
own draw, and a seeded request's tokens are those of plain sampling, position for position (up to
the rounding of a different kernel: the parity tests' near-tie rule).

A grammar sees only what it allows: a constrained sequence's drafts are cut before the first
token its matcher refuses (`GrammarChecked`), the masks of its positions are filled with the
matcher advanced by the drafts before each and rolled back (engine/grammar_masks.py), and after
the pick it consumes only the tokens the step keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.choices import ChoiceState, ChoiceTable
from engine.sampler import TokenHistory, TokenLogprobs
from generation.sampling_params import SamplingParams
from scheduler import Sequence, StepPlan
from scheduler.speculation import Proposal, Proposer

if TYPE_CHECKING:  # llguidance is imported only when a request has a grammar
    from llguidance import LLMatcher


@dataclass(slots=True)
class GrammarChecked:
    """The engine's proposer: `inner`'s drafts, cut for a constrained sequence before the first
    token its grammar refuses (a refused draft could never be kept: its position's mask sets it
    to -inf)."""

    inner: Proposer
    choices: ChoiceTable

    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        proposal = self.inner.propose(seq, max_tokens)
        if proposal.tokens and seq.seq_id in self.choices.constrained:
            matcher = self.choices.by_seq[seq.seq_id].matcher
            assert matcher is not None
            allowed = matcher.validate_tokens(proposal.tokens)
            proposal = Proposal(proposal.tokens[:allowed], proposal.kind)
        return proposal


def draft_rows(plan: StepPlan) -> dict[str, int]:
    """Sequence id -> its chunk's leading positions whose logits the step must also return."""
    return {c.seq_id: c.num_draft_tokens for c in plan.chunks if c.num_draft_tokens}


@dataclass(slots=True)
class PickRows:
    """Every row a step picks a token for: the sampling rows (one per chunk that samples, in
    chunk order), then the draft rows (each verifying sequence's k positions, in chunk order).
    Row r picks for `reqs[r]` as if the first `offsets[r]` of its drafts were its output."""

    reqs: list[ChoiceState] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    # Sampling row i's draft rows are num_sampling + first[i] ..; with k = offsets[i] of them.
    first: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, reqs: list[ChoiceState], seq_ids: list[str], drafts: dict[str, int]) -> PickRows:
        if not drafts:  # (most steps: one row per sampling chunk, nothing verified)
            zeros = [0] * len(reqs)
            return cls(reqs, zeros, zeros)
        counts = [drafts.get(seq_id, 0) for seq_id in seq_ids]
        owners = [i for i, k in enumerate(counts) for _ in range(k)]
        first, at = [], 0
        for k in counts:
            first.append(at)
            at += k
        offsets = counts + [j for k in counts for j in range(k)]
        return cls(reqs + [reqs[i] for i in owners], offsets, first)

    def drafts_before(self, row: int) -> list[int]:
        return self.reqs[row].seq.speculation.draft_token_ids[: self.offsets[row]]

    def params(self) -> list[SamplingParams]:
        return [r.params for r in self.reqs]

    def positions(self) -> list[int]:
        """Each row's output index: where its draw is in the request's random stream."""
        return [r.seq.num_output_tokens + j for r, j in zip(self.reqs, self.offsets, strict=True)]

    def histories(self) -> list[TokenHistory]:
        histories = []
        for row, req in enumerate(self.reqs):
            seq = req.seq
            output = seq.output_token_ids
            if self.offsets[row]:
                output = output + self.drafts_before(row)
            histories.append(TokenHistory(seq.prompt_token_ids, output, seq.limits.stop_token_ids))
        return histories

    def constrained(self) -> list[int]:
        return [row for row, req in enumerate(self.reqs) if req.matcher is not None]


@dataclass(slots=True)
class Verified:
    """One sampling row's tokens of the step and whether its grammar ended it."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    grammar_done: bool


def verify(
    picks: PickRows,
    row: int,
    tokens: list[int],
    found: list[TokenLogprobs | None] | None,
) -> Verified:
    """Sampling row `row`'s tokens: the drafts that equal the picks at their positions, then
    the first pick that differs (or the one after the last draft), cut after a token that ends
    its grammar (or that the grammar refused); the kept tokens advance its matcher."""
    req = picks.reqs[row]
    k = picks.offsets[row]
    at = len(picks.first) + picks.first[row]
    rows = [*range(at, at + k), row]
    drafts = req.seq.speculation.draft_token_ids
    n = 0
    while n < k and drafts[n] == tokens[rows[n]]:
        n += 1
    kept = [tokens[r] for r in rows[: n + 1]]
    done = False
    if req.matcher is not None and (cut := grammar_cut(req.matcher, kept)) is not None:
        del kept[cut:]
        done = True
    logprobs = []
    if found is not None and req.params.logprobs is not None:
        logprobs = [found[r] for r in rows[: len(kept)]]
    return Verified(kept, logprobs, done)  # type: ignore[arg-type]


def grammar_cut(matcher: LLMatcher, tokens: list[int]) -> int | None:
    """Advance `matcher` by `tokens` until one ends its grammar: how many tokens are kept then
    (None: the grammar goes on). A token the mask allowed is always accepted; a refused one
    (every token masked, e.g. min_tokens holding back the only end the grammar leaves) ends the
    request too."""
    for n, token in enumerate(tokens, 1):
        if not matcher.consume_token(token) or matcher.is_stopped():
            return n
    return None
