"""The worker's prefix summary: which prompt blocks its prefix cache holds, its load and the LoRA
adapters it holds resident, in Redis.

Gateways read it to place a request on the worker already holding its prompt's start
(protocol/queue/placement.py, gateway/serving/placement.py). It is a hash expiring with the
worker's lease (the heartbeat renews it): a field per cached block (`summary_hash`, 8 bytes),
the load fields and the resident adapters (a request under one is placed where it need not be
read from its files first). Each step the loop asks `update` for the changes since the last one:
the block manager logs the hashes that entered or left its cache (scheduler/prefix_cache_log.py),
so a step costs what changed, not what is cached, and at most MAX_CHANGES_PER_STEP hashes go per
step (the rest the next step). The update rides on the step's publish (no round trip of its own).

It is advisory: a summary a little behind costs a gateway a miss, never a wrong answer (the
worker's own lookup uses the whole hash). When the worker cannot trust what Redis holds (a new or
rebuilt block pool, a publish refused while fenced, a summary Redis lost) it starts it afresh:
the summary is reset and the whole cache sent again over the next steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.engine_view import EngineView
from generation.block_hash import summary_hash
from protocol.queue.placement import (
    ADAPTERS_FIELD,
    BLOCK_SIZE_FIELD,
    ROOM_FIELD,
    SUMMARY_TTL_MS,
    WAITING_FIELD,
    SummaryUpdate,
    adapters_value,
)

# Block hashes sent per step at most (8 bytes each: 4 KiB), so a resync of a large cache is
# spread over steps instead of stalling one; a prefill step commits at most its token budget's
# worth of blocks (2,048 tokens are 128 blocks of 16).
MAX_CHANGES_PER_STEP = 512


@dataclass(slots=True)
class PrefixSummary:
    key: str  # Keys.prefix_summary(worker)
    max_changes: int = MAX_CHANGES_PER_STEP
    restarting: bool = True  # the next update resets the summary and resends the whole cache
    # Summary hashes not yet sent, in the order they entered the cache (a dict as ordered set).
    to_add: dict[bytes, None] = field(default_factory=dict)
    to_remove: set[bytes] = field(default_factory=set)
    sent_load: dict[str, int | str] = field(default_factory=dict)

    def restart(self) -> None:
        """What Redis holds cannot be trusted: reset it and send everything again."""
        self.restarting = True

    def update(
        self, view: EngineView, room: int, waiting: int, adapters: Iterable[str] = ()
    ) -> SummaryUpdate | None:
        """The summary's changes since the last update (None: nothing changed). `adapters`: the
        LoRA adapters resident in the engine now."""
        changes = view.drain_prefix_cache_changes()
        reset = self.restarting or changes.resync
        if reset:
            self.restarting = False
            self.to_add = dict.fromkeys(summary_hash(h) for h in view.cached_block_hashes())
            self.to_remove.clear()
            self.sent_load = {}
        else:
            for h in changes.added:
                short = summary_hash(h)
                self.to_remove.discard(short)
                self.to_add[short] = None
            for h in changes.removed:
                short = summary_hash(h)
                self.to_add.pop(short, None)
                self.to_remove.add(short)
        update = SummaryUpdate(self.key, SUMMARY_TTL_MS, reset)
        budget = self.max_changes
        while self.to_remove and budget:  # stale fields first: each costs a gateway a miss
            update.removed.append(self.to_remove.pop())
            budget -= 1
        while self.to_add and budget:
            short = next(iter(self.to_add))
            del self.to_add[short]
            update.added.append(short)
            budget -= 1
        load: dict[str, int | str] = {
            ROOM_FIELD: room,
            WAITING_FIELD: waiting,
            BLOCK_SIZE_FIELD: view.block_size,
            ADAPTERS_FIELD: adapters_value(adapters),
        }
        update.load = {k: v for k, v in load.items() if self.sent_load.get(k) != v}
        self.sent_load = load
        return update if update else None
