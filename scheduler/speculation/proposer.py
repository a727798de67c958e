"""The proposer seam and the speculation settings the scheduler reads."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Protocol

SPECULATIVE_METHODS = ("none", "ngram")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's names where it has them (`num_speculative_tokens`, `prompt_lookup_max/min`)."""

    method: str = "none"
    # The most draft tokens one sequence verifies in a step.
    num_speculative_tokens: int = 4
    # n-gram sizes tried, longest first: the last n tokens are looked up earlier in the sequence.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Drafts only while the step's rows (every chunk's tokens, drafts included) stay within
    # this: a step costs about the same for a few rows as for one only while it is bound by
    # reading the weights; past that it is bound by arithmetic and every rejected draft is paid
    # for. 5 is this 2-core CPU's (bench/traces/quoting.json, mixed-64: docs/performance.md);
    # a GPU stays bound by the weight read to far more rows.
    max_step_tokens: int = 5

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.max_step_tokens < 2:
            raise ValueError("speculative max_step_tokens must be >= 2 (a token and a draft)")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class Proposer(Protocol):
    def propose(self, token_ids: SequenceABC[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses of the tokens that follow `token_ids` (may be none)."""
        ...
