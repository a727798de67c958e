"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's tail.

Answers that quote their prompt (summaries, rewrites, code edits, extracted names) repeat spans
of it; when the last n tokens appeared before, what came after them then is a cheap guess of
what comes now. Longer n-grams are tried first (fewer, better matches); the latest occurrence
wins (the most recent context is likeliest to continue alike). With an `OutputHistory`, a tail
that matched fewer than HISTORY_BELOW tokens of the sequence's own text (or none) asks the
earlier replies instead, when they know its context (history.py).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from scheduler.sequence import Sequence
from scheduler.speculation.history import OutputHistory, history_kind
from scheduler.speculation.proposer import Proposal

# An own match this long beats the history's: it keeps more of its drafts (mixed-64, quoting).
HISTORY_BELOW = 3


@dataclass(slots=True, frozen=True)
class NgramProposer:
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    history: OutputHistory | None = None

    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        return self.follow(seq.token_ids(0, seq.num_tokens), max_tokens)

    def follow(self, token_ids: SequenceABC[int], max_tokens: int) -> Proposal:
        """The drafts after `token_ids`: its own tail's match, or the history's."""
        own = self.match(token_ids, max_tokens)
        if self.history is None or own.kind >= HISTORY_BELOW:
            return own
        drafts, order = self.history.propose(token_ids, max_tokens)
        return Proposal(drafts, history_kind(order)) if drafts else own

    def lookup(self, token_ids: SequenceABC[int], max_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the tail of `token_ids`."""
        return self.match(token_ids, max_tokens).tokens

    def match(self, token_ids: SequenceABC[int], max_tokens: int) -> Proposal:
        """`lookup`'s drafts, of the kind of the tail's length (their odds differ by it)."""
        n_tokens = len(token_ids)
        if max_tokens < 1:
            return Proposal([])
        for n in range(min(self.prompt_lookup_max, n_tokens - 1), self.prompt_lookup_min - 1, -1):
            tail = list(token_ids[n_tokens - n :])
            first = tail[0]
            # Latest start i < n_tokens - n whose n tokens equal the tail.
            for i in range(n_tokens - n - 1, -1, -1):
                if token_ids[i] == first and list(token_ids[i : i + n]) == tail:
                    return Proposal(list(token_ids[i + n : i + n + max_tokens]), n)
        return Proposal([])
