"""Finding work nobody holds: requests of dead workers, handed-back requests, dead gateways.

A worker's lease is its heartbeat in `{p}:workers`. A consumer of the group that holds pending
entries but no lease is dead (or is the `released` consumer, which holds handed-back entries).
A live worker with room takes such entries over:
1. it fences the dead consumer first (`{p}:fenced:{id}`): should that worker be alive after all
   (a long pause, a partition), its next publish is refused, so two workers never interleave
   writes for one request;
2. XCLAIM with a minimum idle time, so when several workers race for one entry exactly one wins
   (a claim resets the idle time the others' claims test);
3. it reads back the replies already published for the request (from the request's reply
   stream, `WorkerRedis.claim`) and continues after them: their tokens are the engine's
   delivered output (worker/intake.py); a stream that lost some of them ends the request with
   an error instead (its client's text cannot be continued exactly).
Unlike XAUTOCLAIM with an idle timeout, a long healthy generation is never stolen: a live worker's
entries are not touched however long they run.

A request delivered more than MAX_DELIVERIES times is poison (it has failed or killed a worker
every time): it is dead-lettered instead of started. On its last chance it runs as this worker's
only last-chance request, so one poison cannot drag the same innocent requests down with it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol import HEARTBEAT_TTL_S, MAX_DELIVERIES, RELEASED_CONSUMER
from worker.redis_io import Claimed, Orphan, WorkerRedis

SCAN_INTERVAL_S = 0.5
# Claims skip entries delivered more recently than this: it decides races between claimers.
CLAIM_MIN_IDLE_MS = 1000
# A gateway silent this long is gone for good: its reply stream and heartbeat are deleted.
GATEWAY_GONE_S = 60.0
# Consumers of dead workers with nothing pending are removed at most this often.
CONSUMER_CLEANUP_INTERVAL_S = 60.0


@dataclass(slots=True)
class ScanResult:
    claimed: list[Claimed] = field(default_factory=list)
    dead_gateways: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Takeover:
    io: WorkerRedis
    lease_s: float = HEARTBEAT_TTL_S
    max_deliveries: int = MAX_DELIVERIES
    next_scan: float = 0.0  # monotonic
    next_cleanup: float = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self.next_scan

    def after_outage(self) -> None:
        """Every lease lapsed while Redis was away: give the others a lease period to renew
        theirs before judging anyone dead (no mass takeover of healthy work)."""
        self.next_scan = time.monotonic() + self.lease_s

    def scan(self, capacity: int, holds_last_chance: bool) -> ScanResult:
        """One look at the roster: dead gateways, and up to `capacity` orphaned entries claimed
        (poison ones beyond that: dead-lettering them needs no room)."""
        self.next_scan = time.monotonic() + SCAN_INTERVAL_S
        roster = self.io.roster(self.lease_s)
        now = time.time()
        result = ScanResult(
            dead_gateways={g for g, beat in roster.gateways.items() if beat < now - self.lease_s}
        )
        gone = [g for g, beat in roster.gateways.items() if beat < now - GATEWAY_GONE_S]
        if gone:
            self.io.forget_gateways(gone, [self.io.keys.replies(g) for g in gone])
        me = self.io.worker_id
        unleased = [c for c in roster.consumers if c != me and c not in roster.live_workers]
        orphaned = [c for c in unleased if roster.consumers[c] > 0]
        self._cleanup([c for c in unleased if c not in orphaned and c != RELEASED_CONSUMER])
        if not orphaned:
            return result
        self.io.fence([c for c in orphaned if c != RELEASED_CONSUMER])
        candidates = self.io.orphans(orphaned, max(capacity, 1) + self.max_deliveries)
        picked = self._pick(candidates, capacity, holds_last_chance)
        result.claimed = self.io.claim(picked, CLAIM_MIN_IDLE_MS)
        return result

    def is_poison(self, claimed: Claimed) -> bool:
        return claimed.deliveries > self.max_deliveries

    def is_last_chance(self, deliveries: int) -> bool:
        return deliveries == self.max_deliveries

    def _pick(
        self, candidates: list[Orphan], capacity: int, holds_last_chance: bool
    ) -> list[Orphan]:
        picked: list[Orphan] = []
        room, last_chance_free = capacity, not holds_last_chance
        for orphan in candidates:
            deliveries = orphan.times_delivered + 1
            if deliveries > self.max_deliveries:
                picked.append(orphan)  # dead-lettered at once
            elif room > 0 and (not self.is_last_chance(deliveries) or last_chance_free):
                picked.append(orphan)
                room -= 1
                last_chance_free &= not self.is_last_chance(deliveries)
        return picked

    def _cleanup(self, idle_consumers: list[str]) -> None:
        if idle_consumers and time.monotonic() >= self.next_cleanup:
            self.next_cleanup = time.monotonic() + CONSUMER_CLEANUP_INTERVAL_S
            self.io.forget_consumers(idle_consumers)
