"""Batch state in Redis, shared by every gateway, changed only by atomic scripts.

A batch is a hash (`Keys.batch`): its fields, status, counts, and `next`, the first line no
gateway has claimed yet. Lines are claimed by index with a lease (`Keys.batch_leases`, index ->
expiry); a line's result is written with HSETNX into `Keys.batch_results`, so however many times
a line runs (a lease lapsed under a slow gateway, a dead one), it is answered exactly once and
counted once. Status changes happen in scripts that check the status first, so with several
gateways each transition happens once:

    in_progress --all lines answered--> finalizing --files written--> completed
    in_progress --past expires_at, no live lease--> finalizing --> expired
    in_progress --cancel--> cancelling --no live lease--> cancelled

Finalizing (building the output and error files) is itself leased: a gateway that dies while
writing them is replaced once its lease lapses; the commit renames the files into place only if
the batch is still unfinished, so two finalizers never both commit.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from protocol import Keys

COMPLETION_WINDOW_S = {"24h": 24 * 3600}
OUTPUT_PREFIX, ERROR_PREFIX = "+", "-"  # a stored result: for the output file, or the error file
UNFINISHED = ("in_progress", "finalizing", "cancelling")

# KEYS: batch, leases, results, input lines. ARGV: count, now, lease until.
# Expired leases first (their gateway died, or handed them back), then lines never claimed.
# Returns a flat list: index, line (false if the input file was deleted), ...
_CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return {} end
local now = tonumber(ARGV[2])
if now >= tonumber(redis.call('HGET', KEYS[1], 'expires_at')) then return {} end
local want, out = tonumber(ARGV[1]), {}
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, want)
for _, index in ipairs(stale) do
  if redis.call('HEXISTS', KEYS[3], index) == 1 then
    redis.call('ZREM', KEYS[2], index)
  else
    redis.call('ZADD', KEYS[2], ARGV[3], index)
    table.insert(out, index)
    table.insert(out, redis.call('LINDEX', KEYS[4], index))
  end
end
local first = tonumber(redis.call('HGET', KEYS[1], 'next'))
local last = math.min(first + want - #out / 2, tonumber(redis.call('HGET', KEYS[1], 'total'))) - 1
if last >= first then
  local lines = redis.call('LRANGE', KEYS[4], first, last)
  for i = first, last do
    redis.call('ZADD', KEYS[2], ARGV[3], i)
    table.insert(out, tostring(i))
    table.insert(out, lines[i - first + 1] or false)
  end
  redis.call('HSET', KEYS[1], 'next', last + 1)
end
return out
"""

# KEYS: batch, results, leases. ARGV: index, stored result, counter (completed | failed).
# 1: recorded; 0: the line was answered already (or the batch is past taking answers).
_RECORD = """
redis.call('ZREM', KEYS[3], ARGV[1])
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'cancelling' then
  if tonumber(redis.call('HGET', KEYS[1], 'finalizer_until')) > 0 then return 0 end
elseif status ~= 'in_progress' then
  return 0
end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
return 1
"""

# KEYS: batch, leases. ARGV: now, finalizer lease until.
# The final status this caller is now to write the files for, or false.
_BEGIN_FINALIZE = """
local status = redis.call('HGET', KEYS[1], 'status')
local now = tonumber(ARGV[1])
local live = redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf')
if status == 'in_progress' then
  local b = redis.call('HMGET', KEYS[1], 'completed', 'failed', 'total', 'expires_at')
  local final
  if tonumber(b[1]) + tonumber(b[2]) >= tonumber(b[3]) then
    final = 'completed'
  elseif now >= tonumber(b[4]) and live == 0 then
    final = 'expired'
  else
    return false
  end
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[1],
             'final_status', final)
elseif status == 'cancelling' then
  if live > 0 then return false end
  redis.call('HSET', KEYS[1], 'final_status', 'cancelled')
elseif status ~= 'finalizing' then
  return false
end
if tonumber(redis.call('HGET', KEYS[1], 'finalizer_until')) > now then return false end
redis.call('HSET', KEYS[1], 'finalizer_until', ARGV[2])
return redis.call('HGET', KEYS[1], 'final_status')
"""

# KEYS: batch, active, output file, its lines, error file, their lines, output temp, error temp.
# ARGV: batch id, now, output file object or '', its id, error file object or '', its id.
_COMMIT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'finalizing' and status ~= 'cancelling' then
  redis.call('DEL', KEYS[7], KEYS[8])
  return 0
end
if ARGV[3] ~= '' then
  redis.call('RENAME', KEYS[7], KEYS[4])
  redis.call('PERSIST', KEYS[4])
  redis.call('HSET', KEYS[3], 'object', ARGV[3])
  redis.call('HSET', KEYS[1], 'output_file_id', ARGV[4])
end
if ARGV[5] ~= '' then
  redis.call('RENAME', KEYS[8], KEYS[6])
  redis.call('PERSIST', KEYS[6])
  redis.call('HSET', KEYS[5], 'object', ARGV[5])
  redis.call('HSET', KEYS[1], 'error_file_id', ARGV[6])
end
local final = redis.call('HGET', KEYS[1], 'final_status')
redis.call('HSET', KEYS[1], 'status', final, final .. '_at', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: batch. ARGV: now. The status after the call.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  return 'cancelling'
end
return status
"""

_TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    total: int
    completed: int
    failed: int
    times: dict[str, int | None]
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: dict[str, str] | None = None

    @classmethod
    def from_hash(cls, h: dict[bytes, bytes]) -> Batch:
        f = {k.decode(): v.decode() for k, v in h.items()}
        return cls(
            id=f["id"],
            endpoint=f["endpoint"],
            input_file_id=f["input_file_id"],
            completion_window=f["completion_window"],
            status=f["status"],
            total=int(f["total"]),
            completed=int(f["completed"]),
            failed=int(f["failed"]),
            times={t: int(float(f[t])) if f.get(t) else None for t in _TIMES},
            output_file_id=f.get("output_file_id") or None,
            error_file_id=f.get("error_file_id") or None,
            metadata=json.loads(f["metadata"]) if f.get("metadata") else None,
        )

    def to_json(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            **self.times,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }


@dataclass(frozen=True, slots=True)
class Claimed:
    index: int
    line: bytes | None  # None: the input file was deleted under the batch


class BatchStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis = redis
        self.keys = keys
        self._claim = redis.register_script(_CLAIM)
        self._record = redis.register_script(_RECORD)
        self._begin_finalize = redis.register_script(_BEGIN_FINALIZE)
        self._commit = redis.register_script(_COMMIT)
        self._cancel = redis.register_script(_CANCEL)

    async def create(
        self,
        endpoint: str,
        input_file_id: str,
        total: int,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> Batch:
        batch_id = "batch_" + uuid.uuid4().hex
        now = int(time.time())
        # The input was checked at upload, so the batch starts at once ("validating" is never
        # seen).
        fields = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "metadata": "" if metadata is None else json.dumps(metadata),
            "status": "in_progress",
            "total": total,
            "next": 0,
            "completed": 0,
            "failed": 0,
            "finalizer_until": 0,
            "created_at": now,
            "in_progress_at": now,
            "expires_at": now + COMPLETION_WINDOW_S[completion_window],
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping=fields)
        order = time.time()  # sub-second: the list's order (newest first) is creation order
        pipe.zadd(self.keys.batches, {batch_id: order})
        pipe.zadd(self.keys.active_batches, {batch_id: order})
        await pipe.execute()
        batch = await self.get(batch_id)
        assert batch is not None
        return batch

    async def get(self, batch_id: str) -> Batch | None:
        h = await self.redis.hgetall(self.keys.batch(batch_id))
        return Batch.from_hash(h) if h else None

    async def list(self, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """Newest first, from after `after` (a batch id); and whether more follow."""
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(self.keys.batches, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = await self.redis.zrevrange(self.keys.batches, start, start + limit)
        batches = [b for i in ids[:limit] if (b := await self.get(i.decode())) is not None]
        return batches, len(ids) > limit

    async def active(self) -> list[str]:
        """Unfinished batches, oldest first: the runners' work."""
        return [i.decode() for i in await self.redis.zrange(self.keys.active_batches, 0, -1)]

    async def cancel(self, batch_id: str) -> str:
        return (await self._cancel(keys=[self.keys.batch(batch_id)], args=[time.time()])).decode()

    async def claim(self, batch: Batch, count: int, lease_s: float) -> list[Claimed]:
        now = time.time()
        keys = [
            self.keys.batch(batch.id),
            self.keys.batch_leases(batch.id),
            self.keys.batch_results(batch.id),
            self.keys.file_lines(batch.input_file_id),
        ]
        flat = await self._claim(keys=keys, args=[count, now, now + lease_s])
        return [Claimed(int(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]

    async def record(self, batch_id: str, index: int, result: str, ok: bool) -> bool:
        """The line's result, once: False if it was answered already (a duplicate run)."""
        keys = [
            self.keys.batch(batch_id),
            self.keys.batch_results(batch_id),
            self.keys.batch_leases(batch_id),
        ]
        stored = (OUTPUT_PREFIX if ok else ERROR_PREFIX) + result
        counter = "completed" if ok else "failed"
        return bool(await self._record(keys=keys, args=[index, stored, counter]))

    async def renew(self, leases: dict[str, list[int]], lease_s: float) -> None:
        """Extend the leases of lines still running here (XX: a line answered meanwhile, or
        claimed by no one any more, stays as it is)."""
        until = time.time() + lease_s
        pipe = self.redis.pipeline(transaction=False)
        for batch_id, indices in leases.items():
            pipe.zadd(self.keys.batch_leases(batch_id), dict.fromkeys(indices, until), xx=True)
        await pipe.execute()

    async def release(self, leases: dict[str, list[int]]) -> None:
        """Hand lines back unanswered: their leases expire now, so any gateway claims them."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id, indices in leases.items():
            pipe.zadd(self.keys.batch_leases(batch_id), dict.fromkeys(indices, 0), xx=True)
        await pipe.execute()

    async def begin_finalize(self, batch_id: str, lease_s: float) -> str | None:
        """The final status to write the files for, if this caller is to write them now."""
        now = time.time()
        keys = [self.keys.batch(batch_id), self.keys.batch_leases(batch_id)]
        final = await self._begin_finalize(keys=keys, args=[now, now + lease_s])
        return final.decode() if final else None

    async def results(self, batch_id: str) -> dict[int, bytes]:
        """Every recorded result, by line index (with its OUTPUT_PREFIX / ERROR_PREFIX)."""
        out: dict[int, bytes] = {}
        async for index, value in self.redis.hscan_iter(
            self.keys.batch_results(batch_id), count=1000
        ):
            out[int(index)] = value
        return out

    async def commit(
        self,
        batch_id: str,
        output: tuple[str, str] | None,
        error: tuple[str, str] | None,
        temps: tuple[str, str],
    ) -> bool:
        """Put the written files in place and the batch in its final status, unless another
        finalizer did already. `output` / `error`: (file id, file object JSON), or None."""
        out_id, out_obj = output or ("", "")
        err_id, err_obj = error or ("", "")
        keys = [
            self.keys.batch(batch_id),
            self.keys.active_batches,
            self.keys.file(out_id),
            self.keys.file_lines(out_id),
            self.keys.file(err_id),
            self.keys.file_lines(err_id),
            *temps,
        ]
        args = [batch_id, int(time.time()), out_obj, out_id, err_obj, err_id]
        return bool(await self._commit(keys=keys, args=args))
