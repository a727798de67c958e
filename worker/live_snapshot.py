"""The worker's live batch view: a snapshot of its batch, published at most twice a second.

Built from the engine's read-only view (engine/engine_view.py) on the engine loop's thread, after
a step (the engine is not thread-safe, so never from the heartbeat thread), and written in one
SET that expires with the worker's lease.
The view is best effort: a failed build or write is logged once and never reaches the loop.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from engine.engine_view import SequenceView
from engine.llm_engine import Engine
from protocol import HEARTBEAT_TTL_S, Keys
from protocol.snapshot import (
    DECODE,
    FINISHED,
    PREEMPTED,
    PREFILL,
    SNAPSHOT_INTERVAL_S,
    WAITING,
    BatchSnapshot,
    Seat,
)
from scheduler import SchedulerStats, SequenceStatus
from worker.placement_metrics import OUTCOMES, WAIT_S
from worker.request_book import TrackedRequest

logger = logging.getLogger("jitney.worker")

# Waiting and preempted sequences shown after the running ones (the count says how many more).
WAITING_SEATS = 16
# Request ids go out as a hash prefix: whoever watches the view cannot quote (or cancel) them.
SHORT_ID_HEX = 8
FULL_IDS_ENV = "JITNEY_LIVE_VIEW_FULL_IDS"


@functools.lru_cache(maxsize=4096)  # a request is in every snapshot while it runs: hash it once
def short_id(request_id: str) -> str:
    return hashlib.blake2b(request_id.encode(), digest_size=SHORT_ID_HEX // 2).hexdigest()


def phase(seq: SequenceView) -> str:
    status = seq.status
    if status is SequenceStatus.RUNNING:
        # More than the last sampled token to compute: a prefill (chunked, or a recompute).
        return PREFILL if seq.num_uncomputed_tokens > 1 else DECODE
    if status is SequenceStatus.WAITING:
        return WAITING
    if status is SequenceStatus.PREEMPTED:
        return PREEMPTED
    return FINISHED


def build_snapshot(
    engine: Engine,
    worker_id: str,
    model: str,
    full_ids: bool = False,
    waiting_seats: int = WAITING_SEATS,
    tracked: Mapping[str, TrackedRequest] | None = None,
    reads: Mapping[str, float] | None = None,
) -> BatchSnapshot:
    """`tracked`: the worker's book (request id -> what came with it: its API key id);
    `reads`: entries read by where they waited and their waits (worker/placement_metrics.py)."""
    view = engine.view
    seats = [
        Seat(
            seq.request_id if full_ids else short_id(seq.request_id),
            seq.index,
            phase(seq),
            seq.num_output_tokens,
            seq.max_tokens,
            seq.num_computed_tokens,
            seq.num_tokens,
            seq.priority,
            _key_id(tracked, seq.request_id),
            seq.num_step_tokens,
            seq.adapter,
        )
        for seq in view.sequences(waiting_seats)
    ]
    stats = engine.stats
    return BatchSnapshot(
        worker=worker_id,
        model=model,
        time=time.time(),
        max_num_seqs=view.max_num_seqs,
        kv_used=view.kv_used_blocks,
        kv_total=view.kv_total_blocks,
        running=view.num_running,
        waiting=view.num_waiting,
        batch_size=stats.batch_size,
        step_ms=engine.last_step_timing.total * 1000,
        limit=stats.limit.value,
        seats=seats,
        prefix=_prefix_stats(stats, reads or {}),
    )


def _prefix_stats(stats: SchedulerStats, reads: Mapping[str, float]) -> dict[str, float]:
    """The prefix hit rate, the entries read by where they waited and their mean wait (ms)."""
    queried = stats.num_prefix_queries_total
    hit_rate = stats.num_prefix_hits_total / queried if queried else 0.0
    counts = {o: float(reads.get(o, 0)) for o in OUTCOMES}
    read = sum(counts.values())
    wait_ms = 1000 * reads.get(WAIT_S, 0.0) / read if read else 0.0
    return {"hit_rate": round(hit_rate, 4), **counts, "wait_ms": round(wait_ms, 2)}


def _key_id(tracked: Mapping[str, TrackedRequest] | None, request_id: str) -> str | None:
    request = None if tracked is None else tracked.get(request_id)
    return None if request is None else request.key_id


@dataclass(slots=True)
class SnapshotPublisher:
    """Call `maybe_publish` once per loop iteration; it publishes at most every `interval_s`."""

    client: redis.Redis
    keys: Keys
    worker_id: str
    model: str
    interval_s: float = SNAPSHOT_INTERVAL_S
    full_ids: bool = field(
        default_factory=lambda: os.environ.get(FULL_IDS_ENV, "").lower() in {"1", "true", "yes"}
    )
    _next_at: float = 0.0
    _failing: bool = False

    def maybe_publish(
        self,
        engine: Engine,
        tracked: Mapping[str, TrackedRequest] | None = None,
        reads: Mapping[str, float] | None = None,
    ) -> None:
        now = time.monotonic()
        if now < self._next_at:
            return
        self._next_at = now + self.interval_s
        try:
            snapshot = build_snapshot(
                engine, self.worker_id, self.model, self.full_ids, tracked=tracked, reads=reads
            )
            key = self.keys.live_batch(self.worker_id)
            self.client.set(key, snapshot.encode(), px=int(HEARTBEAT_TTL_S * 1000))
        except Exception as e:  # the view must never break serving, whatever went wrong
            # Redis away: try again a lease later, not every iteration (each try may wait on a
            # connect timeout the loop's own calls already pay).
            self._next_at = now + HEARTBEAT_TTL_S
            if not self._failing:
                logger.warning("live_view_unpublished error=%s", type(e).__name__)
            self._failing = True
            return
        if self._failing:
            logger.info("live_view_published_again")
        self._failing = False
