"""Backpressure: refuse new work (429) while a model's request stream is over its bounds.

One monitor per served model (each has its own stream and counter). Two bounds, both shared by
all gateways, checked before XADD:
- entries not yet delivered to any worker: the `workers` group's `lag` (XINFO GROUPS, Redis 7+);
- prompt tokens of those entries: the `{p}:queued_tokens:{model}` counter, raised by a gateway
  in the same MULTI as its XADD and lowered by the worker that reads the entries. A worker killed
  between its read and its decrement would leave the counter too high for good, so whenever a
  reading finds the queue empty the counter is reset to 0 (atomically, in a script that checks
  the lag).
The reading is reused for `cache_s` so the check costs nothing under load; entries and tokens
this gateway added since the reading are counted on top, so a burst inside one cache window
cannot overshoot the bounds.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.errors import ApiError
from protocol import WORKER_GROUP, Keys, RequestMessage

# Resets the queued-token counter to 0 if the group's lag is 0 (nothing queued), so a counter a
# crashed worker left too high heals the next time the queue drains. KEYS: stream, counter.
# ARGV: the workers' group. Registered once and called by SHA (see BacklogMonitor.__init__).
_RESET_IF_EMPTY = """
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return 0 end
for _, g in ipairs(groups) do
  local name, lag
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'lag' then lag = g[i + 1] end
  end
  if name == ARGV[1] and lag == 0 then
    redis.call('SET', KEYS[2], 0)
    return 1
  end
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Backlog:
    lag: int  # entries added to the stream that no worker has read yet
    pending: int  # entries read by a worker and not yet acknowledged (in progress)
    queued_tokens: int = 0  # prompt tokens of the `lag` entries


def _field(group: dict[Any, Any], name: str) -> Any:
    value = group.get(name, group.get(name.encode()))
    return value.decode() if isinstance(value, bytes) else value


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
    ):
        self.redis = redis
        self.model = model
        self.requests = keys.requests(model)
        self.queued_tokens = keys.queued_tokens(model)
        self.max_queue_len = max_queue_len
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.cache_s = cache_s
        self._reading: Backlog | None = None
        self._read_at = -float("inf")
        self._fetching: asyncio.Future[Backlog] | None = None
        self._enqueued_since_reading = 0
        self._tokens_since_reading = 0
        # register_script: EVALSHA, and SCRIPT LOAD + EVALSHA again on NOSCRIPT (a restarted
        # Redis has an empty script cache).
        self._reset_if_empty = redis.register_script(_RESET_IF_EMPTY)

    async def ensure_group(self) -> None:
        """Create the consumer group at id 0, so nothing enqueued before any worker is skipped."""
        try:
            await self.redis.xgroup_create(self.requests, WORKER_GROUP, id="0", mkstream=True)
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

    def release(self, prompt_tokens: int) -> None:
        """Undo an admit() whose XADD failed."""
        self._enqueued_since_reading = max(self._enqueued_since_reading - 1, 0)
        self._tokens_since_reading = max(self._tokens_since_reading - prompt_tokens, 0)

    async def enqueue(self, message: RequestMessage) -> str:
        """XADD the request and count its prompt tokens as queued, atomically. No MAXLEN:
        trimming the request stream could delete unread requests."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.requests, message.encode())
        pipe.incrby(self.queued_tokens, len(message.prompt_token_ids))
        entry_id, _ = await pipe.execute()
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

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
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_groups(self.requests)
        pipe.get(self.queued_tokens)
        try:
            groups, tokens = await pipe.execute()
        except ResponseError:  # no stream at all (e.g. Redis restarted empty): recreate it
            await self.ensure_group()
            groups, tokens = await self.redis.xinfo_groups(self.requests), 0
        group = next((g for g in groups if _field(g, "name") == WORKER_GROUP), None)
        queued_tokens = max(int(tokens or 0), 0)
        if group is None:
            await self.ensure_group()
            lag, pending = await self.redis.xlen(self.requests), 0
        else:
            lag = _field(group, "lag")
            if lag is None:  # Redis cannot say after some deletions: count, up to the bound
                lag = await self._count_undelivered(_field(group, "last-delivered-id"))
            lag, pending = int(lag), int(_field(group, "pending") or 0)
        if lag == 0 and queued_tokens > 0:
            keys = [self.requests, self.queued_tokens]
            await self._reset_if_empty(keys=keys, args=[WORKER_GROUP])
            queued_tokens = 0
        backlog = Backlog(lag, pending, queued_tokens)
        self._reading = backlog
        self._read_at = time.monotonic()
        # Entries added while XINFO was in flight may or may not be in its answer; keep them.
        self._enqueued_since_reading -= min(enqueued_before, self._enqueued_since_reading)
        self._tokens_since_reading -= min(tokens_before, self._tokens_since_reading)
        return backlog

    async def _count_undelivered(self, last_delivered_id: str) -> int:
        entries = await self.redis.xrange(
            self.requests, min=f"({last_delivered_id}", count=self.max_queue_len + 1
        )
        return len(entries)


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
