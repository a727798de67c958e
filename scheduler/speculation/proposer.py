"""The proposer seam and the speculation settings the scheduler reads.

The continuous policy asks its proposer for a decoding sequence's drafts while it plans a step
(`Proposer.propose`). A pure proposer answers from the sequence's tokens (n-gram); a model
proposer (a draft model, later an EAGLE/MTP head) lives in the engine, computes every
speculating sequence's drafts in one batched pass before the step is planned, and answers from
what it computed (engine/draft_model.py): the scheduler never waits on a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from scheduler.speculation.history import HISTORY_TOKENS
from scheduler.speculation.row_cost import break_even

if TYPE_CHECKING:
    from scheduler.sequence import Sequence

# "draft": a small model's greedy proposals, from the engine's draft model (speculator.py).
SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's names where it has them (`num_speculative_tokens`, `prompt_lookup_max/min`)."""

    method: str = "none"
    # The most draft tokens one sequence verifies in a step.
    num_speculative_tokens: int = 7
    # n-gram sizes tried, longest first: the last n tokens are looked up earlier in the sequence.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Drafts only while the step's rows (every chunk's tokens, drafts included) stay within
    # this: a step costs about the same for a few rows as for one only while it is bound by
    # reading the weights; past that it is bound by arithmetic and every rejected draft is paid
    # for. 8 is this CPU's: its one-pass kernel serves up to 8 tokens (8 cost 1.5x one, 4 cost
    # 1.13x; bench/traces/quoting.json, mixed-64: docs/notes/speculation.md); a GPU stays bound
    # by the weight read to far more rows.
    max_step_tokens: int = 8
    # What one more row costs, as a share of a one-row step: a draft is verified only while the
    # odds of keeping it pay for its row (scheduler/speculation/odds.py). 0.1-0.25 on the CPU
    # kernels (engine/kernels/build.py DRAFT_ROW_COST; with measure_row_cost only the start);
    # 0: every draft the other limits allow.
    draft_row_cost: float = 0.1
    # Whether the engine measures the row's cost from its own steps, draft_row_cost only the
    # starting guess (row_cost.py); off when a cost was configured.
    measure_row_cost: bool = True
    # Earlier replies' n-grams kept for lookups (scheduler/speculation/history.py), in tokens;
    # 0: a sequence's own text only.
    history_tokens: int = HISTORY_TOKENS
    # Whether prompt lookup also resumes a copy after a token an edit replaced (ngram.py).
    prompt_lookup_resume: bool = True
    # vLLM's disable_by_batch_size: no drafts while more sequences than this are running (a
    # deployment's own cut-off, under the one max_step_tokens sets); None: that one alone.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.history_tokens < 0:
            raise ValueError("speculative history_tokens must be >= 0")
        if self.max_step_tokens < 2:
            raise ValueError("speculative max_step_tokens must be >= 2 (a token and a draft)")
        if not 0.0 <= self.draft_row_cost <= 1.0:
            raise ValueError("speculative draft_row_cost must be within [0, 1]")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative disable_by_batch_size must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def batch_speculates(self, running: int) -> bool:
        """Whether a step with `running` sequences may verify drafts at all: a batch with no
        rows to spare (max_step_tokens), or past the configured cut-off, never does."""
        cutoff = self.disable_by_batch_size
        return running < self.max_step_tokens and (cutoff is None or running <= cutoff)

    def num_drafts(self, seq: Sequence, rows: int) -> int:
        """The most drafts `seq` may verify in a step of `rows` rows before them (its own token
        counted; 0: none): a decoding sequence the engine lets speculate, within
        num_speculative_tokens, the step's rows, and max_tokens (the kept drafts and the token
        sampled after them). The continuous policy asks it per sequence while it plans; a model
        proposer before, of every running sequence at the fewest rows a step can have (one per
        sequence). Which of them pay is the odds' call (`break_even`)."""
        decoding = seq.num_output_tokens and seq.num_uncomputed_tokens == 1
        if not seq.speculation.enabled or not decoding:
            return 0
        room = min(
            self.num_speculative_tokens,
            self.max_step_tokens - rows,
            seq.limits.max_tokens - seq.num_output_tokens - 1,
        )
        return max(room, 0)

    def break_even(self, batch: int) -> float:
        """row_cost.break_even at the configured row cost (the policy's measured one moves
        away from it: `Speculator.row_cost`)."""
        return break_even(self.draft_row_cost, batch)


@dataclass(slots=True, frozen=True)
class Proposal:
    """A proposer's drafts and their kind, which keys their measured odds (DraftOdds): an n-gram
    lookup's tail length (a resumed copy's and the history's apart: ngram.py, history.py),
    MODEL_KIND (0) for a model's."""

    tokens: list[int]
    kind: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        """Up to `max_tokens` guesses of the tokens that follow `seq`'s (may be none)."""
        ...
