"""The reply demux: one reader task per gateway reads its reply stream and routes by request id.

Invariants:
- exactly one XREAD loop per process, whatever the number of in-flight requests (no polling);
- per request, replies reach the handler in seq order with duplicates (seq already delivered)
  dropped: delivery is at-least-once, e.g. after a worker reclaimed a dead worker's request;
- what was read is trimmed away (XTRIM MINID) except the replies of requests still in flight:
  the stream is also the record a worker taking a request over continues from (the replies
  already published for it), so it holds the in-flight requests' replies and nothing older;
- `queued_prompt_tokens` counts prompt tokens of requests no worker has started (no reply yet),
  and `waiting_by_priority` those requests by priority;
- after a Redis outage, a request no worker had started whose entry is gone from the request
  stream (Redis came back empty) ends with a final "abort": its client gets a clear 503 at once
  instead of waiting for a reply that cannot come. Started ones go on: their worker still has
  them and writes to the (recreated) reply stream. Workers delete an entry together with its
  final reply, so the reply stream is drained before an entry is called lost;
- a reply past the next seq means the ones between are gone (Redis restarted without
  persistence after the worker published them and before this reader read them): the stream
  cannot go on exactly, so the request ends there with an explicit "abort" (its client gets the
  error, never a text with tokens missing) and its work is cancelled (`on_gap`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.serving.tasks import cancel_and_wait
from protocol import ProtocolError, ReplyMessage, decode_replies

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
READ_COUNT = 512
GAP = "Part of the reply was lost while the queue (Redis) restarted; retry."


@dataclass(slots=True, eq=False)
class InFlight:
    request_id: str
    prompt_tokens: int
    queue: asyncio.Queue[ReplyMessage] = field(default_factory=asyncio.Queue)
    next_seq: int = 0  # replies with seq < next_seq were delivered already
    started: bool = False  # a reply arrived: a worker has it, it is no longer queued
    priority: int = 0
    entry_id: str | None = None  # its request stream entry, once XADD returned
    request_stream: str = ""  # the stream that entry is in (its model's)
    lost_replies: bool = False  # ended at a gap in its replies: later ones are not delivered


def next_stream_id(entry_id: str) -> str:
    """The smallest id after `entry_id` (XTRIM MINID keeps ids >= its argument)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


class ReplyRouter:
    def __init__(self, redis: aioredis.Redis, stream: str, block_ms: int):
        self.redis = redis
        self.stream = stream
        self.block_ms = block_ms
        self._in_flight: dict[str, InFlight] = {}
        self._last_id = "0-0"
        self._trimmed_to = "0-0"
        # Started requests in flight -> the stream entry of their first reply, in stream order
        # (inserted as read): the first value is the oldest entry still to keep.
        self._retained: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self.queued_prompt_tokens = 0
        # Kept at 0 once seen, so a priority's gauge drops to 0 rather than vanishing.
        self.waiting_by_priority: Counter[int] = Counter()
        self.num_duplicates = 0
        self.on_duplicate: Callable[[], None] = lambda: None  # metrics hook
        # Called with a request's id when a gap in its replies ended it: stop its work.
        self.on_gap: Callable[[str], None] = lambda request_id: None
        self.num_orphans = 0  # replies for requests nobody waits for (client gone)
        self.healthy = False  # the last read succeeded
        self._outage = False  # a read failed since the last check for lost requests

    def register(self, request_id: str, prompt_tokens: int, priority: int = 0) -> InFlight:
        entry = InFlight(request_id, prompt_tokens, priority=priority)
        self._in_flight[request_id] = entry
        self.queued_prompt_tokens += prompt_tokens
        self.waiting_by_priority[priority] += 1
        return entry

    def unregister(self, request_id: str) -> None:
        self._retained.pop(request_id, None)
        entry = self._in_flight.pop(request_id, None)
        if entry is not None and not entry.started:
            self._started(entry)

    def _started(self, entry: InFlight) -> None:
        """It no longer waits (a worker started it, or it ended before that)."""
        self.queued_prompt_tokens -= entry.prompt_tokens
        self.waiting_by_priority[entry.priority] -= 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="jitney-reply-reader")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                if self._outage:
                    await self._abort_lost()
                    self._outage = False
                await self._read_once()
                self.healthy = True
                backoff = BACKOFF_MIN_S
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                if self.healthy:
                    log.warning("reply reader: redis error %s; retrying", type(e).__name__)
                self.healthy = False
                self._outage = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            except Exception:  # a bug must not silently stop every reply of this gateway
                log.exception("reply reader: unexpected error; retrying")
                await asyncio.sleep(BACKOFF_MAX_S)

    async def _read_once(self, block_ms: int | None = -1) -> int:
        """Route one batch of replies (blocking up to `block_ms`, the default: self.block_ms;
        None: not at all); returns how many were read."""
        block = self.block_ms if block_ms == -1 else block_ms
        result = await self.redis.xread({self.stream: self._last_id}, count=READ_COUNT, block=block)
        n = 0
        for _stream, entries in result or []:
            for entry_id, fields in entries:
                self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self.dispatch(fields, self._last_id)
                n += 1
        await self._trim()
        return n

    async def _trim(self) -> None:
        """Drop what was routed, but not the replies of requests still in flight (an exact
        MINID trim, only when that bound moved: a request ended, or more was read)."""
        if self._last_id == "0-0":
            return
        keep = next(iter(self._retained.values()), None) or next_stream_id(self._last_id)
        if keep != self._trimmed_to:
            await self.redis.xtrim(self.stream, minid=keep, approximate=False)
            self._trimmed_to = keep

    async def _abort_lost(self) -> None:
        waiting = [e for e in self._in_flight.values() if not e.started and e.entry_id]
        if not waiting:
            return
        pipe = self.redis.pipeline(transaction=False)
        for entry in waiting:
            pipe.xrange(entry.request_stream, entry.entry_id, entry.entry_id, count=1)
        found = await pipe.execute()
        missing = [entry for entry, entries in zip(waiting, found, strict=True) if not entries]
        if not missing:
            return
        # A missing entry may have finished: its final reply went out with its deletion, so
        # it is in the reply stream by now. Route everything there before calling one lost.
        while await self._read_once(block_ms=None) == READ_COUNT:
            pass
        for entry in missing:
            if not entry.started and entry.request_id in self._in_flight:
                log.warning("request lost in a redis outage request_id=%s", entry.request_id)
                lost = ReplyMessage(
                    entry.request_id,
                    entry.next_seq,
                    finish_reason="abort",
                    error="The request was lost while the queue (Redis) restarted; retry.",
                )
                self._deliver(entry, lost)

    def dispatch(self, fields: dict[bytes, bytes], entry_id: str | None = None) -> None:
        """Route one stream entry: a reply, or a worker step's batch of them."""
        try:
            replies = decode_replies(fields)
        except ProtocolError as e:
            log.warning("reply reader: dropped unreadable entry: %s", e)
            return
        for reply in replies:
            self._route(reply, entry_id)

    def _route(self, reply: ReplyMessage, entry_id: str | None) -> None:
        entry = self._in_flight.get(reply.request_id)
        if entry is None or entry.lost_replies:  # nobody waits, or it ended at a gap
            self.num_orphans += 1
            return
        if reply.seq < entry.next_seq:
            self.num_duplicates += 1
            self.on_duplicate()
            return
        if reply.seq > entry.next_seq:
            log.warning(
                "reply gap request_id=%s expected seq=%d got %d",
                reply.request_id,
                entry.next_seq,
                reply.seq,
            )
            entry.lost_replies = True
            lost = ReplyMessage(reply.request_id, entry.next_seq, finish_reason="abort", error=GAP)
            self._deliver(entry, lost)
            self.on_gap(reply.request_id)
            return
        if entry_id is not None and reply.request_id not in self._retained:
            self._retained[reply.request_id] = entry_id
        self._deliver(entry, reply)

    def _deliver(self, entry: InFlight, reply: ReplyMessage) -> None:
        entry.next_seq = reply.seq + 1
        if not entry.started:
            entry.started = True
            self._started(entry)
        entry.queue.put_nowait(reply)
