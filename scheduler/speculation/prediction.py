"""Predicted outputs: drafts from the text the caller expects the reply to be.

OpenAI's chat API takes a `prediction` (Predicted Outputs): most of the reply is known in
advance, as when a file is edited and sent back whole. Its tokens are the best drafts there are
while the reply follows them, and verification keeps only what the model itself picks, so a
wrong prediction costs rows, never a token.

The reply is followed through the prediction: while its new tokens are the prediction's next
ones, the drafts are what comes after them. Where the reply leaves it (an edit), its tail is
looked up in the prediction, as prompt lookup looks up a sequence's text (the same n-gram sizes,
and past one replaced token too); among the places it occurs, the first that does not lie
behind where the reply last stood (edits move forward through a file), else the last one. The
drafts' kinds are apart from prompt lookup's, so their odds are measured apart: in step, and
found again by an n-token tail.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from scheduler.speculation.proposer import Proposal

PREDICTION_KIND = 1 << 17  # + 0: in step; + n: found again by an n-token tail
RESUMED_OFFSET = 1 << 8  # + this: found again past a replaced token


def prediction_kind(n: int = 0, skip: int = 0) -> int:
    return PREDICTION_KIND + n + (RESUMED_OFFSET if skip else 0)


def is_prediction_kind(kind: int) -> bool:
    return kind >= PREDICTION_KIND


@dataclass(slots=True)
class Prediction:
    tokens: tuple[int, ...]
    # Where the reply last stood in the prediction: (its output tokens then, the position after
    # the prediction's token aligned with its last one).
    synced: tuple[int, int] = (0, 0)
    # False once the reply's tokens since `synced` differ from the prediction's there: output
    # only grows, so they differ for good, and the growing comparison is not made again.
    in_step: bool = True
    # n-gram -> its starts in the prediction, ascending; built when the reply first leaves it.
    starts: dict[tuple[int, ...], list[int]] | None = field(default=None, repr=False)

    def propose(
        self, output: SequenceABC[int], max_tokens: int, lookups: list[tuple[int, int]]
    ) -> Proposal:
        """Up to `max_tokens` of the prediction after where `output` stands in it; `lookups`:
        the (n, tokens skipped) tails tried, in order, when it left the prediction."""
        found = self._position(output, lookups)
        if found is None:
            return Proposal([])
        at, kind = found
        self.synced, self.in_step = (len(output), at), True
        return Proposal(list(self.tokens[at : at + max_tokens]), kind)

    def _position(
        self, output: SequenceABC[int], lookups: list[tuple[int, int]]
    ) -> tuple[int, int] | None:
        done, at = self.synced
        num_output = len(output)
        if self.in_step:
            new = list(output[done:num_output])
            if list(self.tokens[at : at + len(new)]) == new:
                return at + len(new), prediction_kind()
            self.in_step = False
        for n, skip in lookups:
            end = num_output - skip  # the reply's own tokens only: [end - n, end)
            if end - n < 0:
                continue
            starts = self._starts_of(tuple(output[end - n : end]), lookups)
            if starts:
                i = bisect_left(starts, at - n)  # the first that ends at or after `at`
                start = starts[i] if i < len(starts) else starts[-1]
                return start + n + skip, prediction_kind(n, skip)
        return None

    def _starts_of(self, ngram: tuple[int, ...], lookups: list[tuple[int, int]]) -> list[int]:
        if self.starts is None:
            self.starts = {}
            for n in sorted({n for n, _ in lookups}):
                for start in range(len(self.tokens) - n + 1):
                    self.starts.setdefault(self.tokens[start : start + n], []).append(start)
        return self.starts.get(ngram, [])
