"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's tail.

Answers that quote their prompt (summaries, rewrites, code edits, extracted names) repeat spans
of it; when the last n tokens appeared before, what came after them then is a cheap guess of
what comes now. Longer n-grams are tried first (fewer, better matches); the latest occurrence
wins (the most recent context is likeliest to continue alike). With an `OutputHistory`, a tail
that matched fewer than HISTORY_BELOW tokens of the sequence's own text (or none) asks the
earlier replies instead, when they know its context (history.py).

A copy that an edit interrupts (a renamed variable, a changed number or address) ends in a token
the source does not have there, so its tail matches nowhere and the step decodes plainly. With
`resume`, the n tokens before that one are looked up too, and the drafts take the copy up again
after the token it replaced. Tried after the 2-token n-grams and before single tokens (bundled
model, replies of bench/traces/quoting.json, every proposal verified: 2.26 tokens a step with
n-grams of 2-4, 2.50 with resumed copies; 2.52 and 2.62 with single tokens last), under kinds of
their own, whose odds price them (a resumed 4-gram's first draft was kept 39% of the time).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from scheduler.sequence import Sequence
from scheduler.speculation.history import OutputHistory, history_kind
from scheduler.speculation.ngram_index import NONE, NgramIndex
from scheduler.speculation.prediction import PREDICTION_KIND
from scheduler.speculation.proposer import Proposal

# An own match this long beats the history's: it keeps more of its drafts (mixed-64, quoting).
HISTORY_BELOW = 3
# A resumed copy's kind is this plus its n-gram's length: apart from prompt lookup's own (n),
# a draft model's (0) and the history's (negative).
RESUME_KIND = 1 << 16


def resume_kind(n: int) -> int:
    return RESUME_KIND + n


def is_resume_kind(kind: int) -> bool:
    return RESUME_KIND < kind < PREDICTION_KIND


@dataclass(slots=True, frozen=True)
class NgramProposer:
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    history: OutputHistory | None = None
    resume: bool = True

    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        """`follow`'s drafts for a sequence, its text looked up in its own NgramIndex (kept on
        the sequence, extended by the tokens each step added); the caller's prediction of the
        reply, where it has one and it gives drafts, first."""
        prediction = seq.speculation.prediction
        if prediction is not None and max_tokens >= 1:
            predicted = prediction.propose(seq.output_token_ids, max_tokens, self.lookups())
            if predicted.tokens:
                return predicted
        own = self._indexed_match(seq, max_tokens)
        num_tokens = seq.num_tokens
        return self._or_history(
            own, lambda n: seq.token_ids(max(0, num_tokens - n), num_tokens), max_tokens
        )

    def follow(self, token_ids: SequenceABC[int], max_tokens: int) -> Proposal:
        """The drafts after `token_ids`: its own tail's match, or the history's."""
        own = self.match(token_ids, max_tokens)
        return self._or_history(own, lambda n: token_ids[-n:], max_tokens)

    def _or_history(
        self, own: Proposal, tail: Callable[[int], SequenceABC[int]], max_tokens: int
    ) -> Proposal:
        """`own`, or the history's drafts after the text's last `history.order` tokens (`tail`)
        when own matched fewer than HISTORY_BELOW tokens, or only as a resumed copy."""
        if self.history is None or (own.kind >= HISTORY_BELOW and not is_resume_kind(own.kind)):
            return own
        drafts, order = self.history.propose(tail(self.history.order), max_tokens)
        return Proposal(drafts, history_kind(order)) if drafts else own

    def _indexed_match(self, seq: Sequence, max_tokens: int) -> Proposal:
        """`match` over the sequence's text, each lookup one probe of its index."""
        if max_tokens < 1:
            return Proposal([])
        lookups = self.lookups()
        index = seq.speculation.lookup_index
        sizes = tuple(sorted({n for n, _ in lookups}))
        num_tokens = seq.num_tokens
        # A new index: the first proposal, other n-gram sizes, or (never seen: a sequence's
        # text only grows) a text shorter than the one indexed.
        if index is None or index.sizes != sizes or index.indexed_to >= num_tokens:
            index = seq.speculation.lookup_index = NgramIndex(sizes)
        first = index.first_needed()
        index.extend(seq.token_ids(first, num_tokens), first, num_tokens)
        # The text's last tokens: every tail looked up is in them.
        last = max(0, num_tokens - max(n + skip for n, skip in lookups))
        recent = seq.token_ids(last, num_tokens)
        for n, skip in lookups:
            end = num_tokens - skip  # the n-gram is the text's [end - n, end)
            if end - n < 1:
                continue
            start = index.start_before(tuple(recent[end - n - last : end - last]), end - n)
            if start != NONE:
                after = start + n + skip
                found = seq.token_ids(after, min(after + max_tokens, num_tokens))
                if found:
                    return Proposal(found, resume_kind(n) if skip else n)
        return Proposal([])

    def lookup(self, token_ids: SequenceABC[int], max_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the tail of `token_ids`."""
        return self.match(token_ids, max_tokens).tokens

    def match(self, token_ids: SequenceABC[int], max_tokens: int) -> Proposal:
        """`lookup`'s drafts, of the kind of the match (their odds differ by it)."""
        if max_tokens < 1:
            return Proposal([])
        for n, skip in self.lookups():
            found = self._after(token_ids, n, skip, max_tokens)
            if found:
                return Proposal(found, resume_kind(n) if skip else n)
        return Proposal([])

    def lookups(self) -> list[tuple[int, int]]:
        """(n, tokens skipped) in the order tried: the tail's n-grams, longest first; with
        `resume`, then the n-grams before the tail's last token (2 tokens or more), then single
        tokens."""
        sizes = range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1)
        if not self.resume:
            return [(n, 0) for n in sizes]
        resumed = [(n, 1) for n in sizes if n >= 2]
        return [(n, 0) for n in sizes if n >= 2] + resumed + [(n, 0) for n in sizes if n < 2]

    @staticmethod
    def _after(token_ids: SequenceABC[int], n: int, skip: int, max_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the n tokens that end `skip` tokens
        before the end, less the `skip` tokens after that occurrence (those the tail replaced)."""
        end = len(token_ids) - skip  # the n-gram is token_ids[end - n : end]
        if end - n < 1:
            return []
        tail = list(token_ids[end - n : end])
        first = tail[0]
        # Latest start i < end - n whose n tokens equal the tail.
        for i in range(end - n - 1, -1, -1):
            if token_ids[i] == first and list(token_ids[i : i + n]) == tail:
                start = i + n + skip
                return list(token_ids[start : start + max_tokens])
        return []
