"""What one more row costs a step, measured from the engine's own decode steps.

A draft is worth verifying only if its odds pay for its row (odds.py), so the row's price must
be this machine's: the kernels' level alone does not tell it (the VNNI one pass costs 0.11 of a
step per row on an AMX Xeon and 0.2-0.3 on a Zen 4; docs/notes/speculation.md). The engine reports
each decode-only step's rows (its tokens: one per sequence, plus the drafts) and its seconds;
only steps within the rows a step may spend on drafts count (a fuller batch never speculates,
and runs the batched kernels, whose rows are priced otherwise); per row count a running mean
is kept, and a line fitted through the means, seconds = a + b rows,
prices a row at b / (a + b) of a one-row step. Until two row counts have been seen often enough
the prior (the kernels' level's measured figure, or the configured one) stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A row count's mean counts once this many of its steps were seen (the first steps of a run are
# cold: caches, the allocator).
MIN_STEPS = 8
# Each step moves its row count's mean by this share: the mean follows the last ~32 steps, as
# the contexts grow and the machine's speed drifts.
STEP_WEIGHT = 1 / 32
# A step slower than this many times its row count's mean moves it as if it took that long
# (a preempted thread or a page fault says nothing about rows).
OUTLIER = 3.0
# The fit weighs a row count by its steps, up to this many (a rare count still counts).
MAX_WEIGHT = 64


@dataclass(slots=True)
class RowCost:
    """A draft row's price as a share of a one-row step: `cost`. Fixed at `prior` unless
    `measured` (the engine learns it when no cost was configured)."""

    prior: float
    measured: bool = False
    # Steps of more rows than this are not counted (SpeculativeConfig.max_step_tokens).
    max_rows: int = 8
    # rows -> [steps seen, mean seconds]
    means: dict[int, list[float]] = field(default_factory=dict)
    cost: float = field(init=False)

    def __post_init__(self) -> None:
        self.cost = self.prior

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds` (a step with a prefill chunk, whose
        cost grows with its context, tells nothing about a draft row and is not reported)."""
        if not self.measured or not 1 <= rows <= self.max_rows or seconds <= 0:
            return
        cell = self.means.get(rows)
        if cell is None:
            self.means[rows] = [1, seconds]
            return
        steps, mean = cell
        weight = max(STEP_WEIGHT, 1 / (steps + 1))  # a plain average until the window fills
        cell[0] = steps + 1
        cell[1] = mean + weight * (min(seconds, OUTLIER * mean) - mean)
        self.cost = self._fitted()

    def _fitted(self) -> float:
        """b / (a + b) of the weighted least-squares line through the row counts' means; the
        prior while fewer than two counts have MIN_STEPS steps or the line says nothing."""
        points = [(r, m, min(n, MAX_WEIGHT)) for r, (n, m) in self.means.items() if n >= MIN_STEPS]
        if len(points) < 2:
            return self.prior
        total = sum(w for _, _, w in points)
        mean_r = sum(w * r for r, _, w in points) / total
        mean_s = sum(w * s for _, s, w in points) / total
        spread = sum(w * (r - mean_r) ** 2 for r, _, w in points)
        slope = sum(w * (r - mean_r) * (s - mean_s) for r, s, w in points) / spread
        one_row = mean_s + slope * (1 - mean_r)
        if one_row <= 0:
            return self.prior
        return min(max(slope / one_row, 0.0), 1.0)


def break_even(cost: float, batch: int) -> float:
    """The chance of being kept at which a draft row pays for itself in a step that decodes
    `batch` sequences, a row costing `cost` of a one-row step. Such a step costs
    1 + cost (batch - 1) one-row steps, so a token costs (1 + cost (batch - 1)) / batch of one;
    a kept draft saves a token, a row costs `cost`. Alone (batch 1) a draft pays when kept a
    share `cost` of the time; in a fuller batch tokens are cheaper, and drafts must be likelier."""
    return cost * batch / (1 + cost * (batch - 1))
