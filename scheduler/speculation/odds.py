"""How many of a proposal's drafts are worth verifying: measured odds against a row's cost.

A draft row costs a share of a step (`SpeculativeConfig.draft_row_cost`) whether it is kept or
not; it pays only when it is kept, and it is kept only if every draft before it was. So draft j
is worth its row while the chance that drafts 0..j are all kept is at least what the row costs
in tokens (`SpeculativeConfig.break_even`). The chances are measured per kind of proposal: a
prompt lookup that matched a 4-token tail is kept far more often than one that matched a single
token (bundled model, quoting trace: 94% against 30% for the first draft), and a draft model is
a kind of its own. Counts start from an optimistic prior (a fresh engine drafts in full), are
halved past a window (the workload may change), and a kind whose first draft stopped paying is
still tried with one draft now and then, or its odds could never recover.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Odds of a draft never seen, as counts: 4 kept of 5 (0.8 a position: seven drafts still clear a
# 0.2 break-even, so a fresh engine drafts as it did before it measured anything).
PRIOR_KEPT, PRIOR_TRIED = 4.0, 5.0
# A cell's counts are halved when it has seen this many verifications: recent ones weigh most.
WINDOW = 256
# A sequence's own counts weigh against the engine's as if the engine's were this many tries, and
# are halved sooner: whether its text repeats now is what they tell.
OWN_WEIGHT = 4.0
OWN_WINDOW = 16
# Positions past this share one cell (few proposals reach them).
DEPTH = 8
# Every this-many proposals of a kind cut to nothing, one draft is verified anyway.
PROBE_EVERY = 16
MODEL_KIND = 0  # a draft model's proposals (n-gram proposals are keyed by their tail's length)

# (kind, position) -> [kept, tried]: drafts verified at `position` after kept drafts.
Counts = dict[tuple[int, int], list[float]]


@dataclass(slots=True)
class DraftOdds:
    """The engine's odds, measured over every sequence; each sequence keeps its own counts too
    (`SpeculationState.draft_counts`), which move its odds away from the engine's as they grow."""

    counts: Counts = field(default_factory=dict)
    # kind -> proposals cut to nothing since the last probe.
    refused: dict[int, int] = field(default_factory=dict)

    def chance(self, kind: int, position: int, own: Counts | None = None) -> float:
        """The chance that a draft at `position` is kept, given that those before it were (and,
        with `own`, given the sequence's own verifications)."""
        key = (kind, min(position, DEPTH - 1))
        kept, tried = self.counts.get(key, (0.0, 0.0))
        engine = (kept + PRIOR_KEPT) / (tried + PRIOR_TRIED)
        if not own or key not in own:
            return engine
        kept, tried = own[key]
        return (kept + OWN_WEIGHT * engine) / (tried + OWN_WEIGHT)

    def paying(
        self, kind: int, num_drafts: int, break_even: float, own: Counts | None = None
    ) -> int:
        """How many of `num_drafts` drafts pay: the longest prefix whose last draft is kept
        (with all before it) at least `break_even` of the time."""
        reach, n = 1.0, 0
        while n < num_drafts:
            reach *= self.chance(kind, n, own)
            if reach < break_even:
                break
            n += 1
        return n

    def worth(
        self, kind: int, num_drafts: int, break_even: float, own: Counts | None = None
    ) -> int:
        """How many of `num_drafts` proposed drafts to verify: those that pay, or one for a
        kind refused PROBE_EVERY times in a row."""
        n = self.paying(kind, num_drafts, break_even, own)
        if n == 0 and num_drafts:
            refused = self.refused.get(kind, 0) + 1
            self.refused[kind] = refused % PROBE_EVERY
            return 0 if refused % PROBE_EVERY else 1
        return n

    def record(
        self, kind: int, num_verified: int, num_kept: int, own: Counts | None = None
    ) -> None:
        """A verification of `num_verified` drafts kept the first `num_kept`: each draft up to
        the first rejected one was tried (those after it were not: their odds are conditional)."""
        for position in range(min(num_kept + 1, num_verified)):
            key = (kind, min(position, DEPTH - 1))
            _count(self.counts, key, position < num_kept, WINDOW)
            if own is not None:
                _count(own, key, position < num_kept, OWN_WINDOW)


def _count(counts: Counts, key: tuple[int, int], kept: bool, window: int) -> None:
    cell = counts.setdefault(key, [0.0, 0.0])
    cell[0] += kept
    cell[1] += 1
    if cell[1] >= window:
        cell[0] /= 2
        cell[1] /= 2
