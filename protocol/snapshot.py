"""The live batch view's wire type: what one worker's batch looks like right now.

Each worker SETs its snapshot (compact JSON) under `Keys.live_batch(worker)` at most every
SNAPSHOT_INTERVAL_S, with an expiry of HEARTBEAT_TTL_S: a dead worker's view vanishes with its
lease. Gateways merge the live workers' snapshots for `GET /ui/events`; `jitney top` draws them.
A seat is one sequence (one choice of a request): the running ones, then a few waiting ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import ProtocolError

SNAPSHOT_VERSION = 1
# Twice a second: fresh enough to watch a batch fill, cheap enough to never show in a step.
SNAPSHOT_INTERVAL_S = 0.5

PREFILL = "prefill"  # computing its prompt (or recomputing prompt + output after a preemption)
DECODE = "decode"
PREEMPTED = "preempted"  # back in the queue, its KV freed; recomputed when readmitted
WAITING = "waiting"  # queued, never admitted yet
FINISHED = "finished"  # static/dynamic batching: done, its slot held until the batch ends
PHASES = (PREFILL, DECODE, PREEMPTED, WAITING, FINISHED)


@dataclass(slots=True)
class Seat:
    id: str  # the request id, shortened to a hash prefix unless the worker shows full ids
    index: int  # the choice (n > 1)
    phase: str
    done: int  # output tokens so far
    max_tokens: int
    computed: int  # tokens whose K/V is computed (a prefill's progress)
    target: int  # tokens to compute before the next sample: the prompt (+ output on recompute)
    priority: int
    key: str | None = None  # the API key's id, when the gateway has keys
    # Output tokens its latest step gave it: 1 a decode, more a speculative verification (0:
    # none yet, or a worker before this field).
    step_tokens: int = 0
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)

    def to_list(self) -> list[Any]:
        return [
            self.id,
            self.index,
            self.phase,
            self.done,
            self.max_tokens,
            self.computed,
            self.target,
            self.priority,
            self.key,
            self.step_tokens,
            self.adapter,
        ]


# A seat goes on the wire as a list in this order: 64 seats stay around 2.5 kB.
SEAT_FIELDS = (
    "id",
    "index",
    "phase",
    "done",
    "max_tokens",
    "computed",
    "target",
    "priority",
    "key",
    "step_tokens",
    "adapter",
)


@dataclass(slots=True)
class BatchSnapshot:
    worker: str
    model: str
    time: float  # unix seconds when it was taken
    max_num_seqs: int
    kv_used: int  # blocks
    kv_total: int
    running: int
    waiting: int  # all of them; `seats` lists at most the worker's cap
    batch_size: int  # the last step's
    step_ms: float  # the last step's duration
    limit: str  # what bounded the last step (scheduler.plan.StepLimit's value)
    seats: list[Seat] = field(default_factory=list)
    # Prefix caching and placement since the worker started (absent from older workers):
    # `hit_rate` (cached prompt tokens / looked up), entries read by where they waited (`own`,
    # `shared`, `stolen`: worker/placement_metrics.py) and their mean wait, `wait_ms`.
    prefix: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": SNAPSHOT_VERSION,
            "worker": self.worker,
            "model": self.model,
            "time": round(self.time, 3),
            "max_num_seqs": self.max_num_seqs,
            "kv_used": self.kv_used,
            "kv_total": self.kv_total,
            "running": self.running,
            "waiting": self.waiting,
            "batch_size": self.batch_size,
            "step_ms": round(self.step_ms, 2),
            "limit": self.limit,
            "seat_fields": SEAT_FIELDS,
            "seats": [s.to_list() for s in self.seats],
            "prefix": self.prefix,
        }

    def encode(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Any) -> BatchSnapshot:
        """Raises ProtocolError on anything but a snapshot of this version."""
        version = d.get("v") if isinstance(d, dict) else None
        if version != SNAPSHOT_VERSION:
            raise ProtocolError(f"snapshot version {version!r}, expected {SNAPSHOT_VERSION}")
        try:
            seats = [Seat(*s[: len(SEAT_FIELDS)]) for s in d["seats"]]
            return cls(
                str(d["worker"]),
                str(d["model"]),
                float(d["time"]),
                int(d["max_num_seqs"]),
                int(d["kv_used"]),
                int(d["kv_total"]),
                int(d["running"]),
                int(d["waiting"]),
                int(d["batch_size"]),
                float(d["step_ms"]),
                str(d["limit"]),
                seats,
                _prefix(d.get("prefix")),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ProtocolError(f"bad snapshot: {type(e).__name__}: {e}") from e

    @classmethod
    def decode(cls, raw: str | bytes) -> BatchSnapshot:
        try:
            return cls.from_dict(json.loads(raw))
        except ValueError as e:
            raise ProtocolError(f"snapshot is not JSON: {e}") from e


def _prefix(value: Any) -> dict[str, float] | None:
    """A snapshot's prefix stats: names to numbers, or None (a worker before them)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"prefix is {type(value).__name__}, not an object")
    return {str(k): float(v) for k, v in value.items()}
