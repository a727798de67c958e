"""Backpressure: refuse new work (429) while the request stream's backlog is over its bounds.

Two bounds, checked before XADD:
- entries not yet delivered to any worker: the `workers` group's `lag` (XINFO GROUPS, Redis 7+),
  shared by all gateways. The reading is reused for `cache_s` so the check costs nothing under
  load; entries this gateway added since the reading are counted on top, so a burst inside one
  cache window cannot overshoot the bound.
- prompt tokens this gateway enqueued that no worker has started (ReplyRouter counts them). This
  bound is per gateway: with N gateways the deployment holds at most N × the bound. It needs no
  shared counter, so a crashed gateway cannot leak queued tokens and block everyone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.errors import ApiError
from gateway.replies import ReplyRouter
from jitney.protocol import WORKER_GROUP, Keys


@dataclass(frozen=True, slots=True)
class Backlog:
    lag: int  # entries added to the stream that no worker has read yet
    pending: int  # entries read by a worker and not yet acknowledged (in progress)


def _field(group: dict[Any, Any], name: str) -> Any:
    value = group.get(name, group.get(name.encode()))
    return value.decode() if isinstance(value, bytes) else value


class BacklogMonitor:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        router: ReplyRouter,
        max_queue_len: int,
        max_queued_tokens: int,
        retry_after_s: int = 1,
        cache_s: float = 0.1,
    ):
        self.redis = redis
        self.keys = keys
        self.router = router
        self.max_queue_len = max_queue_len
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.cache_s = cache_s
        self._reading: Backlog | None = None
        self._read_at = -float("inf")
        self._fetching: asyncio.Future[Backlog] | None = None
        self._enqueued_since_reading = 0

    async def ensure_group(self) -> None:
        """Create the consumer group at id 0, so nothing enqueued before any worker is skipped."""
        try:
            await self.redis.xgroup_create(self.keys.requests, WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def reading(self, max_age_s: float | None = None) -> Backlog:
        max_age = self.cache_s if max_age_s is None else max_age_s
        if self._reading is not None and time.monotonic() - self._read_at < max_age:
            return self._reading
        if self._fetching is None:  # one XINFO in flight; concurrent callers share it
            self._fetching = asyncio.ensure_future(self._fetch())
        fetching = self._fetching
        try:
            return await asyncio.shield(fetching)
        finally:
            if fetching.done() and self._fetching is fetching:
                self._fetching = None

    def release(self) -> None:
        """Undo an admit() whose XADD failed."""
        self._enqueued_since_reading = max(self._enqueued_since_reading - 1, 0)

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
        queued = self.router.queued_prompt_tokens
        # A lone request larger than the bound is still admitted: it fits once the queue is empty.
        if queued > 0 and queued + prompt_tokens > self.max_queued_tokens:
            raise self._full(
                f"Too many prompt tokens queued ({queued} + {prompt_tokens} > limit "
                f"{self.max_queued_tokens}); retry later."
            )
        self._enqueued_since_reading += 1

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
        try:
            groups = await self.redis.xinfo_groups(self.keys.requests)
        except ResponseError:  # no stream at all (e.g. Redis restarted empty): recreate it
            await self.ensure_group()
            groups = await self.redis.xinfo_groups(self.keys.requests)
        group = next((g for g in groups if _field(g, "name") == WORKER_GROUP), None)
        if group is None:
            await self.ensure_group()
            backlog = Backlog(lag=await self.redis.xlen(self.keys.requests), pending=0)
        else:
            lag = _field(group, "lag")
            if lag is None:  # Redis cannot say after some deletions: count, up to the bound
                lag = await self._count_undelivered(_field(group, "last-delivered-id"))
            backlog = Backlog(lag=int(lag), pending=int(_field(group, "pending") or 0))
        self._reading = backlog
        self._read_at = time.monotonic()
        # Entries added while XINFO was in flight may or may not be in its answer; keep them.
        self._enqueued_since_reading -= min(enqueued_before, self._enqueued_since_reading)
        return backlog

    async def _count_undelivered(self, last_delivered_id: str) -> int:
        entries = await self.redis.xrange(
            self.keys.requests, min=f"({last_delivered_id}", count=self.max_queue_len + 1
        )
        return len(entries)
