"""How much a worker reads from its queue: what its engine can start now, never more.

A worker never hoards: what it reads it can start now, so another worker gets the rest. From the
engine's view, `num_to_read` takes the seats it can admit and, under continuous batching, bounds
them by the KV blocks free at what a typical request takes at admission: a moving average of
what the requests started lately needed (the prompt, plus max_tokens where admission reserves
it). An idle engine reads one whatever the estimate (a request that cannot fit the whole pool is
refused, not held). A full worker still reads one entry more urgent than what it runs, when its
model has more urgent queues (`preempts_for`): the engine preempts for it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from engine.engine_view import EngineView

TYPICAL_BLOCKS_EMA = 0.2


@dataclass(slots=True)
class Admission:
    typical_blocks: float = 1.0  # KV blocks a request needs at admission (moving average)

    def num_to_read(self, view: EngineView) -> int:
        """How many new requests the engine can start now."""
        seats = view.num_admittable_seats
        if view.runs_to_completion or not seats:
            # A static/dynamic batch runs to completion: read only to assemble the next one.
            return seats
        fit = int(view.kv_free_blocks // self.typical_blocks)
        return min(seats, fit if view.num_running else max(fit, 1))

    def preempts_for(self, view: EngineView, priorities: Collection[int]) -> int | None:
        """The priority below which a full worker still reads (None: it does not): the least
        urgent running one, when some queue of the model (`priorities`) is more urgent."""
        most_urgent = min(priorities)
        if most_urgent == max(priorities):  # one priority: nothing running is less urgent
            return None
        below = view.preemptible_priority()  # a pass over the running sequences
        return None if below is None or most_urgent >= below else below

    def started(self, view: EngineView, prompt_tokens: int, max_tokens: int) -> None:
        """A request was added to the engine: what it needs at admission joins the average."""
        need = prompt_tokens + (max_tokens - 1 if view.reserves_full_length else 0)
        blocks = view.blocks_for(need)
        self.typical_blocks += TYPICAL_BLOCKS_EMA * (blocks - self.typical_blocks)
