"""Prefix-aware placement, seen from a worker: how the entries it read got to it, and their wait.

Every entry read is counted by outcome: from this worker's own stream (a gateway placed it here
for its prefix), from the queue's shared stream (no useful hit, or placement off), or stolen from
another worker's own stream (its owner did not read it within the bound, or left). The wait is
from the gateway's enqueue to this read. Counts are kept for the live view too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

OUTCOMES = ("own", "shared", "stolen")
WAIT_S = "wait_s"
# From a read at the next step (milliseconds) to one past the steal bound (a second or more).
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class PlacementMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        names = (*labels, "outcome")
        reads = Counter(
            "jitney_placement_reads",
            "Request entries read, by where they waited: own stream, shared, stolen",
            names,
            registry=registry,
        )
        waits = Histogram(
            "jitney_placement_wait_seconds",
            "Gateway enqueue to a worker reading the entry, by where it waited",
            names,
            registry=registry,
            buckets=WAIT_BUCKETS,
        )
        # exported from the start: rate() sees 0, not nothing
        self._reads = {o: reads.labels(**labels, outcome=o) for o in OUTCOMES}
        self._waits = {o: waits.labels(**labels, outcome=o) for o in OUTCOMES}
        # The live view's: outcome -> entries read, and WAIT_S, their waits summed.
        self.counts: dict[str, float] = dict.fromkeys((*OUTCOMES, WAIT_S), 0.0)

    def read(self, outcome: str, wait_s: float) -> None:
        """outcome: one of OUTCOMES."""
        wait_s = max(0.0, wait_s)
        self._reads[outcome].inc()
        self._waits[outcome].observe(wait_s)
        self.counts[outcome] += 1
        self.counts[WAIT_S] += wait_s
