"""One request's queue entries, from their registration to the request's end: the skeleton both
paths that enqueue share (completions and chat: gateway.serving.request_path; embeddings:
gateway.serving.embedding_path).

The path admits the request whole, on all its prompts' tokens, then registers its entries at
once (no await in between, so concurrent handlers cannot all pass on one backlog reading). Each
prompt is an entry of its own, `<id>-<i>` when there are several, registered for its replies
before its XADD. A Redis error part-way releases the admission of the entries not in the stream
(503). However the request ends, every entry is unregistered, and each one that may be in the
stream but has not finished is cancelled.

What each path sends is its own (`send`'s `xadd`): a generation entry goes in an enqueue span of
its own, to the worker prefix-aware placement picks; an embedding's entries go to the model's
queue itself and carry the request's span. That difference is the embeddings path as it was
built, kept here; whether placement would pay for embeddings has not been measured.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from gateway.openai.errors import redis_unavailable
from gateway.serving.backlog import BacklogMonitor, Queue
from gateway.serving.gateway_state import Gateway
from gateway.serving.reply_router import InFlight


@dataclass(slots=True)
class QueueEntries:
    """A request's entries: registered together, sent in order, closed once."""

    gw: Gateway
    backlog: BacklogMonitor
    queue: Queue  # the fair-share queue every entry of the request goes to
    prompt_tokens: list[int]  # each entry's
    in_flight: list[InFlight]  # each entry's registration, in prompt order
    sent: int = 0  # entries maybe in the stream: a client gone during an XADD still cancels it

    @classmethod
    def register(
        cls,
        gw: Gateway,
        backlog: BacklogMonitor,
        request_id: str,
        prompts: list[list[int]],
        priority: int,
        key_id: str | None,
        weight: int | None,
    ) -> QueueEntries:
        """Register every prompt's entry for its replies; call it right after the admission."""
        several = len(prompts) > 1
        in_flight = [
            gw.router.register(f"{request_id}-{i}" if several else request_id, len(ids), priority)
            for i, ids in enumerate(prompts)
        ]
        queue = Queue(priority, key_id if weight else None, weight or 1)
        return cls(gw, backlog, queue, [len(ids) for ids in prompts], in_flight)

    async def send(self, xadd: Callable[[int], Awaitable[None]]) -> None:
        """Enqueue entry after entry (`xadd(i)` sends entry i). A Redis error releases the
        admission of that entry and the ones after it (a reading counts the rest) and is a 503."""
        for i in range(len(self.in_flight)):
            self.sent = i + 1
            try:
                await xadd(i)
            except RedisError:
                self.sent = i
                self.backlog.release(sum(self.prompt_tokens[i:]))
                raise redis_unavailable() from None

    def close(self, cancel_reason: Callable[[int], str | None]) -> None:
        """The request ended: unregister every entry and cancel each sent one that
        `cancel_reason(i)` gives a reason for (None: the worker finished it)."""
        for flight in self.in_flight:
            self.gw.router.unregister(flight.request_id)
        for i, flight in enumerate(self.in_flight[: self.sent]):
            reason = cancel_reason(i)
            if reason is not None:
                self.gw.cancel_later(flight.request_id, reason)
