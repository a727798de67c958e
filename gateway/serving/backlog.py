"""Enqueueing, and backpressure: refuse new work (429) while a model's queues are over bounds.

One monitor per served model (each has its own queues and counter). Two bounds, both shared by
all gateways, checked before XADD:
- entries not yet delivered to any worker: the `workers` group's `lag` (XINFO GROUPS, Redis 7+),
  summed over the model's queues;
- prompt tokens of those entries: the `{p}:queued_tokens:{model}` counter, raised by a gateway
  in the same script as its XADD and lowered by the worker that reads the entries. A worker killed
  between its read and its decrement would leave the counter too high for good, so whenever a
  reading finds the queue empty the counter is reset to 0 (atomically, in a script that checks
  the lag).
The reading is reused for `cache_s` so the check costs nothing under load; entries and tokens
this gateway added since the reading are counted on top, so a burst inside one cache window
cannot overshoot the bounds. The entry's fields and both scripts are the queue contract's
(protocol/queue).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter

from gateway.openai.errors import ApiError
from gateway.serving.placement import OUTCOMES, Placement
from gateway.serving.shared_fetch import SharedFetch
from protocol import Keys, RequestMessage
from protocol.queue import (
    DEFAULT_QUEUE,
    Queue,
    backlog_call,
    encode_entry,
    enqueue_call,
    scripts,
)


@dataclass(frozen=True, slots=True)
class Backlog:
    lag: int  # entries added to the stream that no worker has read yet
    pending: int  # entries read by a worker and not yet acknowledged (in progress)
    queued_tokens: int = 0  # prompt tokens of the `lag` entries


class BacklogMonitor:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        model: str,
        max_queue_len: int = 0,
        max_queued_tokens: int = 0,
        retry_after_s: int = 1,
        cache_s: float = 0.1,
        placements: Counter | None = None,
    ):
        self.redis = redis
        self.keys = keys
        self.model = model
        self.queued_tokens = keys.queued_tokens(model)
        self.max_queue_len = max_queue_len
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.cache_s = cache_s
        self._reading: Backlog | None = None
        self._read_at = -float("inf")
        self._fetching = SharedFetch(self._fetch)
        self._enqueued_since_reading = 0
        self._tokens_since_reading = 0
        # register_script: EVALSHA, and SCRIPT LOAD + EVALSHA again on NOSCRIPT (a restarted
        # Redis has an empty script cache).
        self._enqueue = redis.register_script(scripts.ENQUEUE)
        self._read = redis.register_script(scripts.BACKLOG)
        # Prefix-aware placement (gateway/serving/placement.py), counted in `placements`.
        self.placement: Placement | None = None
        if placements is not None:
            counts = {o: placements.labels(model, o) for o in OUTCOMES}  # exported from 0
            self.placement = Placement(redis, keys, model, lambda o: counts[o].inc())

    def queue(self, queue: Queue) -> str:
        return queue.stream(self.keys, self.model)

    async def reading(self, max_age_s: float | None = None) -> Backlog:
        max_age = self.cache_s if max_age_s is None else max_age_s
        if self._reading is not None and time.monotonic() - self._read_at < max_age:
            return self._reading
        return await self._fetching()  # one XINFO in flight; concurrent callers share it

    def release(self, prompt_tokens: int) -> None:
        """Undo an admit() whose XADD failed."""
        self._enqueued_since_reading = max(self._enqueued_since_reading - 1, 0)
        self._tokens_since_reading = max(self._tokens_since_reading - prompt_tokens, 0)

    async def enqueue(self, message: RequestMessage, queue: Queue, cost: int) -> str:
        """XADD the request to its queue and count its prompt tokens as queued, atomically. No
        MAXLEN: trimming a queue could delete unread requests."""
        fields = encode_entry(message, cost)
        prompt_tokens = len(message.prompt_token_ids)
        stream = self.queue(queue)
        if queue == DEFAULT_QUEUE:
            # Every reader knows the default queue: it needs no listing or weight, and a MULTI
            # costs Redis less than a script (what most requests of most deployments take).
            pipe = self.redis.pipeline(transaction=True)
            pipe.xadd(stream, fields)
            pipe.incrby(self.queued_tokens, prompt_tokens)
            entry_id, _ = await pipe.execute()
        else:
            call = enqueue_call(self.keys, self.model, queue, fields, prompt_tokens)
            entry_id = await self._enqueue(keys=call.keys, args=call.args)
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    async def place(self, message: RequestMessage, queue: Queue, cost: int) -> tuple[str, str]:
        """Enqueue as `enqueue` does, on the worker whose prefix cache holds the most of the
        prompt when placement is on and finds one: (the stream it went to, entry id)."""
        if self.placement is not None:
            worker = await self.placement.target(queue, message.prompt_token_ids, message.lora)
            if worker is not None:
                fields = encode_entry(message, cost)
                tokens = len(message.prompt_token_ids)
                return await self.placement.place(worker, queue, fields, tokens)
        return self.queue(queue), await self.enqueue(message, queue, cost)

    async def admit(self, prompt_tokens: int) -> None:
        """Raise 429 if one more request of `prompt_tokens` would overfill the queue; otherwise
        count it as enqueued at once (the caller registers it without awaiting in between), so
        concurrent handlers cannot all pass on the same reading."""
        backlog = await self.reading()
        waiting = backlog.lag + self._enqueued_since_reading
        if waiting >= self.max_queue_len:
            raise self._full(
                f"The request queue is full ({waiting} requests waiting, limit "
                f"{self.max_queue_len}); retry later."
            )
        queued = backlog.queued_tokens + self._tokens_since_reading
        # A lone request larger than the bound is still admitted: it fits once the queue is empty.
        if queued > 0 and queued + prompt_tokens > self.max_queued_tokens:
            raise self._full(
                f"Too many prompt tokens queued ({queued} + {prompt_tokens} > limit "
                f"{self.max_queued_tokens}); retry later."
            )
        self._enqueued_since_reading += 1
        self._tokens_since_reading += prompt_tokens

    def _full(self, message: str) -> ApiError:
        return ApiError(
            429,
            message,
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def _fetch(self) -> Backlog:
        enqueued_before = self._enqueued_since_reading
        tokens_before = self._tokens_since_reading
        call = backlog_call(self.keys, self.model, self.max_queue_len + 1)
        lag, pending, queued_tokens = await self._read(keys=call.keys, args=call.args)
        backlog = Backlog(int(lag), int(pending), max(int(queued_tokens), 0))
        self._reading = backlog
        self._read_at = time.monotonic()
        # Entries added while the reading was in flight may or may not be in it; keep them.
        self._enqueued_since_reading -= min(enqueued_before, self._enqueued_since_reading)
        self._tokens_since_reading -= min(tokens_before, self._tokens_since_reading)
        return backlog


class ModelBacklogs:
    """One BacklogMonitor per model's request stream, made on first use."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, **bounds: Any):
        self.redis = redis
        self.keys = keys
        self.bounds = bounds  # BacklogMonitor's keyword arguments (bounds, caching)
        self._monitors: dict[str, BacklogMonitor] = {}

    def __getitem__(self, model: str) -> BacklogMonitor:
        monitor = self._monitors.get(model)
        if monitor is None:
            monitor = BacklogMonitor(self.redis, self.keys, model, **self.bounds)
            self._monitors[model] = monitor
        return monitor

    async def read(self, max_age_s: float | None = None) -> dict[str, Backlog]:
        """The backlog of every model with a card and of every model enqueued to here."""
        models = {name.decode() for name in await self.redis.smembers(self.keys.models)}
        names = sorted(models | set(self._monitors))
        readings = await asyncio.gather(*(self[name].reading(max_age_s) for name in names))
        return dict(zip(names, readings, strict=True))
