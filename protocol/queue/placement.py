"""Prefix-aware placement's part of the queue contract: own streams, summaries, the steal bound.

Workers pull; placement only adds a hint. Each worker publishes a prefix summary
(`Keys.prefix_summary`, a hash expiring with its lease): a field per block hash its prefix
cache holds (generation/block_hash.py's `summary_hash`: the first SUMMARY_BYTES bytes) and its
load (ROOM_FIELD: requests it could start now; WAITING_FIELD: read but not admitted;
BLOCK_SIZE_FIELD: the hashes' block size), and the LoRA adapters it holds resident
(ADAPTERS_FIELD). A gateway hashes a prompt the same way, asks each live worker's summary how
many of its leading blocks it holds and whether it holds the request's adapter (scripts.LOOKUP),
picks a worker (gateway/serving/placement.py) and enqueues into that worker's own stream of the
request's queue (`Keys.requests(..., worker=...)`; scripts.PLACE, which falls back to the queue
itself when the worker's summary is gone).

Nothing waits on one worker: its own streams are listed in the model's queue set like any
queue, so backlog readings, takeovers, hand-backs and fencing see them; the owner reads its own
stream and the shared one oldest first, and any other worker of the model takes an entry the
owner has not read within STEAL_AFTER_MS (or at once when the owner's summary is gone: it died,
or is leaving). Fair share and priorities are the queue's (scripts.READ).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from protocol.keys import HEARTBEAT_TTL_S

# Whether gateways place and workers publish summaries when not told (`--prefix-placement`):
# off, because with no shared prefixes it only costs (a lookup per request, a read script per
# worker step: TTFT p50 12.5 -> 17.3 ms for the tiny model, docs/performance.md).
PLACEMENT_DEFAULT = False
# The summary's load fields: names of another length than a block hash's SUMMARY_BYTES (8), so
# never one of the hashes the same hash holds.
ROOM_FIELD = "room"
WAITING_FIELD = "waiting"
BLOCK_SIZE_FIELD = "block_size"
# The adapters resident in the worker's engine, as `adapters_value` writes them (LOOKUP finds a
# name in it without parsing).
ADAPTERS_FIELD = "loras"
# An entry in a live worker's own stream that it has not read after this long is anyone's: long
# enough for a worker with room to come round from its current step (a prefill chunk of a small
# model on a CPU takes a few hundred ms), short against what a misplaced request would wait.
STEAL_AFTER_MS = 1000
# A summary lives as long as a lease: the heartbeat renews both.
SUMMARY_TTL_MS = int(HEARTBEAT_TTL_S * 1000)
# LOOKUP counts a stream's unread entries this far when Redis cannot say its lag.
UNREAD_COUNT_BOUND = 100


@dataclass(slots=True)
class SummaryUpdate:
    """A step's changes to a worker's prefix summary, written by its publish (scripts.PUBLISH's
    `S` operation) so they cost no round trip of their own."""

    key: str
    ttl_ms: int
    reset: bool = False  # start the summary afresh (a new or rebuilt prefix cache, a resync)
    added: list[bytes] = field(default_factory=list)  # summary hashes
    removed: list[bytes] = field(default_factory=list)
    load: dict[str, int | str] = field(default_factory=dict)  # the load fields and ADAPTERS_FIELD

    def __bool__(self) -> bool:
        return self.reset or bool(self.added or self.removed or self.load)

    def args(self) -> list[Any]:
        flat_load = [item for pair in self.load.items() for item in pair]
        counts = [len(self.added), len(self.removed), len(self.load)]
        head = ["S", self.key, self.ttl_ms, int(self.reset), *counts]
        return [*head, *self.added, *self.removed, *flat_load]


def adapters_value(names: Iterable[str]) -> str:
    """ADAPTERS_FIELD's value: the names between spaces (" a b "), so that LOOKUP finds one as
    " a " with a plain substring search (an adapter's name holds no whitespace); none: ""."""
    listed = sorted(names)
    return f" {' '.join(listed)} " if listed else ""


class Cached(NamedTuple):
    """One candidate worker as LOOKUP found it."""

    worker: str
    blocks: int  # leading blocks of the prompt its summary holds
    room: int  # requests it could start now (as it last said)
    waiting: int  # requests it read and has not admitted
    unread: int  # entries in its own stream of the request's queue no one has read
    adapter: bool = True  # holds the request's LoRA adapter resident (always, for none)


def lookup_reply(workers: Sequence[str], reply: Sequence[Any]) -> list[Cached]:
    """LOOKUP's reply for `workers` (in the order asked): those with a summary."""
    found = []
    for worker, values in zip(workers, reply, strict=True):
        if int(values[0]) < 0:
            continue  # no summary: gone, or leaving
        blocks, room, waiting, unread, adapter = (int(v) for v in values)
        found.append(Cached(worker, blocks, room, waiting, unread, bool(adapter)))
    return found


class PlacedRead(NamedTuple):
    """READ's additions with placement on."""

    owned: dict[str, str]  # own stream (this worker's or another's) -> the queue it is of
    steal_in_ms: int | None  # until another worker's next entry becomes stealable (None: none)


def placed_read_reply(extra: Sequence[Any]) -> PlacedRead:
    """READ's additions (its reply past the queues and entries) with placement on."""
    flat, steal_in = extra
    owned = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
    wait = int(steal_in)
    return PlacedRead(owned, None if wait < 0 else wait)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
