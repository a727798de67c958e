"""The worker's Redis calls, one method per round trip, so the engine loop reads as steps.

Pure I/O: decoding, validation and logging are the service's. Every key comes from
`protocol.Keys`. Methods raise redis' ConnectionError/TimeoutError; the loop retries.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import redis

from protocol import (
    DEAD_LETTER_MAXLEN,
    FENCE_TTL_S,
    RELEASED_CONSUMER,
    REPLY_STREAM_MAXLEN,
    WORKER_GROUP,
    Keys,
    ModelCard,
    ProtocolError,
    ReplyMessage,
    decode_replies,
    encode_replies,
)
from protocol.redis_client import sync_client

# A blocking read must return before the socket times out (redis-py raises TimeoutError then).
SOCKET_TIMEOUT_MARGIN_S = 5.0
MAX_CANCELS_PER_READ = 1000
# Handed-back entries are marked idle this long, so any claimer's min-idle test passes at once.
RELEASED_IDLE_MS = 24 * 3600 * 1000

# Both scripts run every step or second, so they are registered once and called by SHA
# (redis-py's Script: EVALSHA, and SCRIPT LOAD + EVALSHA again on NOSCRIPT, as after a restart).

# One step's replies and acks, applied atomically unless this worker has been fenced (another
# worker judged it dead and took its requests over): a fenced worker's late writes would
# interleave with its successor's. Returns 0 when fenced, 1 when applied.
# KEYS: fence flag, the model's queue deficits. ARGV: group, reply maxlen, then operations:
#   R stream nomkstream(0|1) v b   (one XADD: a gateway's replies of this step, as a batch)
#   A queue entry_id               (XACK + XDEL of a request queue's entry)
#   F queue tokens                 (a fair-share refund: it lowers the queue's debt, never
#                                   past 0, and only for a queue the round robin keeps)
# Every key named in ARGV shares the deployment's hash tag (protocol.Keys): one cluster slot.
# The reply stream is also the record a takeover continues from (WorkerRedis.claim): no write
# per request besides its reply, which halves what Redis does per streamed token.
_PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local group, maxlen = ARGV[1], ARGV[2]
local i = 3
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'R' then
    local stream, nomk, v, b = ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4]
    if nomk == '1' then
      redis.call('XADD', stream, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'v', v, 'b', b)
    else
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'v', v, 'b', b)
    end
    i = i + 5
  elseif op == 'A' then
    -- pcall: after a restart without persistence the group may be gone; nothing to ack then
    redis.pcall('XACK', ARGV[i+1], group, ARGV[i+2])
    redis.call('XDEL', ARGV[i+1], ARGV[i+2])
    i = i + 3
  else  -- 'F'
    if redis.call('HEXISTS', KEYS[2], ARGV[i+1]) == 1 then
      if redis.call('HINCRBY', KEYS[2], ARGV[i+1], ARGV[i+2]) > 0 then
        redis.call('HSET', KEYS[2], ARGV[i+1], 0)
      end
    end
    i = i + 3
  end
end
return 1
"""

# The heartbeat renews the lease only while not fenced: a fenced worker must not look alive
# until it has handed back what it still holds. It also says whether the model card exists (a
# Redis restart loses it): one call, not a pipeline (a pipeline of scripts costs a SCRIPT EXISTS
# round trip first). The lease is renewed in the model's worker set too (what gateways check to
# serve the model); ids an hour stale leave it (ids are per process: the set would only grow).
# KEYS: fence flag, workers, model card, model workers. ARGV: worker id, now.
# Returns {renewed (1) or fenced (0), card exists (1|0)}.
_HEARTBEAT = """
local has_card = redis.call('EXISTS', KEYS[3])
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, has_card} end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[2] - 3600)
return {1, has_card}
"""

# Read up to `count` new entries of a model's queues for this consumer: most urgent priority
# first; between the queues of one priority, deficit round robin counted in tokens (each entry's
# `c`), weighted by each queue's weight, with the deficits kept in a hash so shares hold across
# reads. Only queues more urgent than ARGV[4] are read (a full worker reads only what it would
# preempt for). A queue without the group gets it at id 0 (a restart without persistence).
# Returns {queues with their priorities (flat), entries as {queue, id, fields}}.
# KEYS: queue set, weights, deficits, default queue. ARGV: group, consumer, count, below
# (a priority, exclusive; READ_ALL for all), quantum (tokens a weight-1 queue gets per round).
_READ = """
local group, consumer, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
local below, quantum = ARGV[4], tonumber(ARGV[5])
local function read(queue, n)
  local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', queue, '>')
  if type(r) == 'table' and r.err then
    if not string.find(r.err, 'NOGROUP') then error(r.err) end
    redis.call('XGROUP', 'CREATE', queue, group, '0', 'MKSTREAM')
    r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', queue, '>')
  end
  if not r then return {} end
  return r[1][2]
end
local function cost(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'c' then return tonumber(fields[i + 1]) or 1 end
  end
  return 1
end
local listed = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local levels, order = {}, {}
local function add(queue, priority)
  if not levels[priority] then levels[priority] = {}; table.insert(order, priority) end
  table.insert(levels[priority], queue)
end
local default_listed = false
for i = 1, #listed, 2 do
  add(listed[i], tonumber(listed[i + 1]))
  default_listed = default_listed or listed[i] == KEYS[4]
end
if not default_listed then
  add(KEYS[4], 0)
  table.insert(listed, KEYS[4])
  table.insert(listed, '0')
end
table.sort(order)
local out = {}
for _, priority in ipairs(order) do
  if #out >= want or priority >= tonumber(below) then break end
  local queues = levels[priority]
  if #queues == 1 then
    for _, e in ipairs(read(queues[1], want - #out)) do
      table.insert(out, {queues[1], e[1], e[2]})
    end
  else
    local weights = redis.call('HMGET', KEYS[2], unpack(queues))
    local deficits = redis.call('HMGET', KEYS[3], unpack(queues))
    local live = #queues
    for k = 1, #queues do
      weights[k] = tonumber(weights[k]) or 1
      deficits[k] = tonumber(deficits[k]) or 0
    end
    local empty = {}
    while #out < want and live > 0 do
      local served = false
      for k = 1, #queues do
        if not empty[k] and deficits[k] > 0 and #out < want then
          local e = read(queues[k], 1)[1]
          if e then
            table.insert(out, {queues[k], e[1], e[2]})
            deficits[k] = deficits[k] - cost(e[2])
            served = true
          else  -- nothing waiting: an idle queue keeps no credit
            empty[k], live = true, live - 1
            if deficits[k] > 0 then deficits[k] = 0 end
          end
        end
      end
      if not served and live > 0 then  -- a new round: enough quanta that one queue can go
        local rounds = math.huge
        for k = 1, #queues do
          if not empty[k] then
            local share = quantum * weights[k]
            rounds = math.min(rounds, math.floor((0 - deficits[k]) / share) + 1)
          end
        end
        for k = 1, #queues do
          if not empty[k] then deficits[k] = deficits[k] + rounds * quantum * weights[k] end
        end
      end
    end
    local flat = {}
    for k = 1, #queues do table.insert(flat, queues[k]); table.insert(flat, deficits[k]) end
    redis.call('HSET', KEYS[3], unpack(flat))
  end
end
return {listed, out}
"""
# Tokens a weight-1 queue gets per round of the deficit round robin. A top-up grants just enough
# rounds for the next queue to go (computed, not looped), so a small quantum costs nothing and
# interleaves request by request: no queue banks credit that a queue arriving later must wait out.
DRR_QUANTUM = 1
READ_ALL = 1_000_000_000  # `below` for reading every priority
# While a model has one queue, reads skip the script but for one every this often (to find a
# first queue of another priority).
LIST_QUEUES_S = 0.5

Fields = dict[bytes, bytes]


@dataclass(slots=True)
class Entry:
    entry_id: str
    fields: Fields
    queue: str = ""  # the request queue (stream) it is in; "" for other streams' entries

    @property
    def ref(self) -> EntryRef:
        return EntryRef(self.queue, self.entry_id)


class EntryRef(NamedTuple):
    """A request queue's entry: what acks, hand-backs and claims name."""

    queue: str
    entry_id: str


@dataclass(slots=True)
class Outbox:
    """Replies and acks of one step, published in one pipelined round trip.

    Kept until a publish succeeds: a failed publish is retried whole (the gateway drops the
    duplicates by seq; XACK is idempotent), so no delta is lost while Redis is away.
    """

    replies: list[tuple[str, ReplyMessage]] = field(default_factory=list)
    acks: list[EntryRef] = field(default_factory=list)  # entries to XACK and XDEL
    # (queue, tokens): what finished requests were charged for fair share and did not use
    refunds: list[tuple[str, int]] = field(default_factory=list)
    # Reply streams of gateways that are gone: replies go only if the stream still exists.
    gone_streams: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.replies or self.acks or self.refunds)


@dataclass(slots=True)
class Orphan:
    """A pending entry whose consumer holds no lease (a dead worker, or handed back)."""

    entry_id: str
    consumer: str
    times_delivered: int
    queue: str


@dataclass(slots=True)
class Claimed:
    entry: Entry
    deliveries: int  # including this claim
    # The replies already published for it, in seq order (published_history); None when the
    # reply stream no longer holds them all (it cannot be continued exactly).
    delivered: list[ReplyMessage] | None


@dataclass(slots=True)
class Roster:
    """Who holds a lease, and which pending entries have no live holder. One round trip."""

    live_workers: set[str]
    consumers: dict[str, int]  # consumer -> pending entries, over all the model's queues
    gateways: dict[str, float]  # gateway id -> last heartbeat (unix seconds)


def resumed_outputs(delivered: Sequence[ReplyMessage], n: int) -> list[int] | dict[int, list[int]]:
    """What a takeover continues after, from the replies already published for a request: its
    delivered tokens (n = 1), or each unfinished choice's (a choice with a final is done)."""
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    for reply in delivered:
        if reply.index in tokens:
            tokens[reply.index] += reply.token_ids
            if reply.is_final:
                del tokens[reply.index]
    return tokens[0] if n == 1 else tokens


def published_history(replies: Sequence[ReplyMessage]) -> list[ReplyMessage] | None:
    """One request's replies in seq order, duplicates dropped; None when they are not all
    there (seq 0, 1, ... with a gap: the stream lost some), so nothing is resumed wrongly."""
    by_seq = {reply.seq: reply for reply in replies}
    ordered = [by_seq[seq] for seq in sorted(by_seq)]
    if [reply.seq for reply in ordered] != list(range(len(ordered))):
        return None
    return ordered


class WorkerRedis:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, model: str):
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        # The served model's request stream: only the workers serving a model read its stream.
        self.model = model
        self.requests = keys.requests(model)  # the default queue: always read
        # The model's queues -> their priorities, as last read (every script read says).
        self.queues: dict[str, int] = {self.requests: 0}
        self._list_queues_at = 0.0  # monotonic: when a read next runs the script regardless
        self.model_workers = keys.model_workers(model)
        self.queued_tokens = keys.queued_tokens(model)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._publish = client.register_script(_PUBLISH)
        self._read = client.register_script(_READ)

    @classmethod
    def connect(
        cls, url: str, keys: Keys, worker_id: str, model: str, idle_block_ms: int
    ) -> WorkerRedis:
        client = sync_client(
            url,
            socket_timeout=idle_block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
            socket_connect_timeout=2.0,
        )
        return cls(client, keys, worker_id, model)

    # ----- joining and leaving -------------------------------------------------------------
    def ensure_group(self) -> None:
        """Create the consumer group (and the stream). From id 0: entries a gateway queued
        before any worker existed are served, not skipped."""
        try:
            self.client.xgroup_create(self.requests, WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def last_cancel_id(self) -> str:
        """Where to start reading cancels: after the newest one now (a non-blocking XREAD
        from "$" would never return anything)."""
        newest = self.client.xrevrange(self.keys.cancels, count=1)
        return newest[0][0].decode() if newest else "0-0"

    def heartbeat(self, card: ModelCard) -> bool:
        """Renew this worker's lease; publish the model card if it is missing (a Redis restart
        lost it). One round trip unless the card is missing. False: this worker is fenced."""
        keys = [
            self.keys.fenced(self.worker_id),
            self.keys.workers,
            self.keys.model(card.name),
            self.model_workers,
        ]
        renewed, has_card = self._heartbeat(keys=keys, args=[self.worker_id, time.time()])
        if not has_card:
            self.publish_card(card)
        return bool(renewed)

    def publish_card(self, card: ModelCard) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.model(card.name), mapping=card.encode())
        pipe.sadd(self.keys.models, card.name)
        pipe.execute()

    def release_own(self) -> int:
        """Hand back every entry this consumer holds (a restarted worker reusing its id, or a
        fenced one): they go to the released consumer, for any live worker to take over."""
        pending = self._own_pending()
        return self.release(list(pending))

    def release(self, entries: Sequence[EntryRef], graceful: bool = False) -> int:
        """Move entries to the released consumer. The delivery count rises by one when a live
        worker takes one; `graceful` (a shutdown, not a failure) first lowers it by one, so
        a rolling update never pushes a request towards the dead-letter stream."""
        if not entries:
            return 0
        counts: dict[tuple[str, int], list[str]] = {}
        delivered = self._own_pending() if graceful else {}
        for ref in entries:
            retry = max(delivered.get(ref, 1) - 1, 0) if graceful else -1
            counts.setdefault((ref.queue, retry), []).append(ref.entry_id)
        pipe = self.client.pipeline(transaction=False)
        for (queue, retry), ids in counts.items():
            # JUSTID leaves the count alone unless RETRYCOUNT sets it.
            pipe.xclaim(
                queue,
                WORKER_GROUP,
                RELEASED_CONSUMER,
                0,
                ids,
                idle=RELEASED_IDLE_MS,
                retrycount=retry if retry >= 0 else None,
                justid=True,
            )
        pipe.execute()
        return len(entries)

    def _own_pending(self) -> dict[EntryRef, int]:
        """This consumer's pending entries, in every queue of the model -> delivery counts."""
        queues = self.list_queues()
        pipe = self.client.pipeline(transaction=False)
        for queue in queues:
            pipe.xpending_range(queue, WORKER_GROUP, "-", "+", 100_000, consumername=self.worker_id)
        found = {}
        results = _unless_no_group(pipe.execute(raise_on_error=False))
        for queue, pending in zip(queues, results, strict=True):
            for p in pending:
                found[EntryRef(queue, _text(p["message_id"]))] = int(p["times_delivered"])
        return found

    def list_queues(self) -> list[str]:
        """Every queue of the model (its set, and the default one), read afresh."""
        listed = self.client.zrange(self.keys.queues(self.model), 0, -1, withscores=True)
        self.queues = {_text(q): int(score) for q, score in listed} | {
            self.requests: self.queues.get(self.requests, 0)
        }
        return list(self.queues)

    def unfence(self) -> None:
        self.client.delete(self.keys.fenced(self.worker_id))

    def leave(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(self.keys.workers, self.worker_id)
        pipe.zrem(self.model_workers, self.worker_id)
        pipe.execute()

    # ----- the loop ------------------------------------------------------------------------
    def read_cancels(self, after: str) -> list[Entry]:
        reply = self.client.xread({self.keys.cancels: after}, count=MAX_CANCELS_PER_READ)
        return _entries(reply)

    def read_requests(
        self, count: int, block_ms: int | None, below: int | None = None
    ) -> list[Entry]:
        """Up to `count` new entries for this consumer, most urgent first, fair between the
        queues of one priority (_READ). Only entries more urgent than `below`, when given. With
        `block_ms`, and nothing there, wait that long for an entry of any queue.

        While the model has only its default queue (as the script last said: it runs at least
        every LIST_QUEUES_S), a plain XREADGROUP does, as before queues per priority existed;
        a first queue of another priority is seen within that interval."""
        now = time.monotonic()
        if below is None and len(self.queues) == 1 and now < self._list_queues_at:
            return self._read_default(count, block_ms)
        self._list_queues_at = now + LIST_QUEUES_S
        keys = [
            self.keys.queues(self.model),
            self.keys.queue_weights(self.model),
            self.keys.queue_deficits(self.model),
            self.requests,
        ]
        limit = READ_ALL if below is None else below
        args = [WORKER_GROUP, self.worker_id, count, limit, DRR_QUANTUM]
        listed, found = self._read(keys=keys, args=args)
        self.queues = {
            _text(listed[i]): int(float(listed[i + 1])) for i in range(0, len(listed), 2)
        }
        entries = [Entry(_text(i), _field_map(f), _text(q)) for q, i, f in found]
        if entries or not block_ms or below is not None:
            return entries
        # Nothing waiting: block on every queue at once (one entry each at most; an idle or
        # nearly idle worker has room for them). A queue made during the wait is seen at the
        # next read, within block_ms.
        return self._xreadgroup(dict.fromkeys(self.queues, ">"), 1, block_ms)

    def _read_default(self, count: int, block_ms: int | None) -> list[Entry]:
        return self._xreadgroup({self.requests: ">"}, count, block_ms)

    def _xreadgroup(self, streams: dict[str, str], count: int, block_ms: int | None) -> list[Entry]:
        try:
            reply = self.client.xreadgroup(
                WORKER_GROUP, self.worker_id, streams, count=count, block=block_ms
            )
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_group()  # Redis restarted without persistence: the group is gone
            self.queues = {self.requests: 0}  # and the other queues: the next read finds them
            return []
        return _entries(reply)

    def dequeue(self, request_ids: Sequence[str], prompt_tokens: int) -> list[bool]:
        """New entries were read: take their prompt tokens off the queued-token counter and say
        which of them were cancelled while queued (one round trip)."""
        pipe = self.client.pipeline(transaction=False)
        if prompt_tokens:
            pipe.decrby(self.queued_tokens, prompt_tokens)
        for request_id in request_ids:
            pipe.exists(self.keys.cancelled(request_id))
        flags = pipe.execute()
        return [bool(n) for n in flags[1 if prompt_tokens else 0 :]]

    def publish(self, outbox: Outbox) -> bool:
        """Apply one step's writes atomically; False (nothing written) if this worker is fenced."""
        args: list[str | int] = [WORKER_GROUP, REPLY_STREAM_MAXLEN]
        by_stream: dict[str, list[ReplyMessage]] = {}
        for stream, reply in outbox.replies:  # in order: a request's seqs stay in order
            by_stream.setdefault(stream, []).append(reply)
        for stream, replies in by_stream.items():
            fields = encode_replies(replies)
            args += ["R", stream, int(stream in outbox.gone_streams), fields["v"], fields["b"]]
        for queue, entry_id in outbox.acks:
            args += ["A", queue, entry_id]
        for queue, tokens in outbox.refunds:
            args += ["F", queue, tokens]
        keys = [self.keys.fenced(self.worker_id), self.keys.queue_deficits(self.model)]
        return bool(self._publish(keys=keys, args=args))

    # ----- taking over orphaned work -------------------------------------------------------
    def roster(self, lease_s: float) -> Roster:
        now = time.time()
        queues = self.list_queues()
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(self.keys.workers, now - lease_s, "+inf")
        pipe.zrange(self.keys.gateways, 0, -1, withscores=True)
        for queue in queues:
            pipe.xinfo_consumers(queue, WORKER_GROUP)
        live, gateways, *per_queue = pipe.execute(raise_on_error=False)
        for result in (live, gateways):
            if isinstance(result, Exception):
                raise result
        if isinstance(per_queue[queues.index(self.requests)], redis.ResponseError):
            self.ensure_group()  # the default queue lost its group: Redis restarted empty
        consumers: dict[str, int] = {}
        for found in _unless_no_group(per_queue):
            for c in found:
                name = _text(c["name"])
                consumers[name] = consumers.get(name, 0) + int(c["pending"])
        return Roster(
            {w.decode() for w in live},
            consumers,
            {_text(g): float(score) for g, score in gateways},
        )

    def fence(self, consumers: Sequence[str]) -> None:
        """Mark workers dead before taking their entries: their late writes are refused."""
        pipe = self.client.pipeline(transaction=False)
        for consumer in consumers:
            pipe.set(self.keys.fenced(consumer), 1, ex=FENCE_TTL_S)
            pipe.zrem(self.keys.workers, consumer)
            pipe.zrem(self.model_workers, consumer)  # consumers of our group serve our model
        pipe.execute()

    def orphans(self, consumers: Sequence[str], count: int) -> list[Orphan]:
        """Up to `count` of each consumer's pending entries per queue, oldest first."""
        queues = list(self.queues)
        pipe = self.client.pipeline(transaction=False)
        pairs = [(consumer, queue) for consumer in consumers for queue in queues]
        for consumer, queue in pairs:
            pipe.xpending_range(queue, WORKER_GROUP, "-", "+", count, consumername=consumer)
        results = _unless_no_group(pipe.execute(raise_on_error=False))
        found = [
            Orphan(_text(p["message_id"]), consumer, int(p["times_delivered"]), queue)
            for (consumer, queue), pending in zip(pairs, results, strict=True)
            for p in pending
        ]
        return sorted(found, key=lambda o: _id_key(o.entry_id))

    def claim(self, orphans: Sequence[Orphan], min_idle_ms: int) -> list[Claimed]:
        """XCLAIM them for this worker (an entry another claimer took first is skipped: the
        min-idle test fails once its idle time was reset) and read the replies already
        published for each from its gateway's reply stream (one XRANGE per stream)."""
        if not orphans:
            return []
        times = {(o.queue, o.entry_id): o.times_delivered for o in orphans}
        by_queue: dict[str, list[str]] = {}
        for o in orphans:
            by_queue.setdefault(o.queue, []).append(o.entry_id)
        entries: list[Entry] = []
        for queue, ids in by_queue.items():
            got = self.client.xclaim(queue, WORKER_GROUP, self.worker_id, min_idle_ms, ids)
            entries += [Entry(_text(i), fields, queue) for i, fields in got if fields]
            gone = [_text(i) for i, fields in got if not fields]  # deleted: nothing to serve
            if gone:
                self.client.xack(queue, WORKER_GROUP, *gone)
        published = self._published([_addressing(entry.fields) for entry in entries])
        return [
            Claimed(
                entry,
                times[(entry.queue, entry.entry_id)] + 1,
                published.get(_request_id(entry.fields)),
            )
            for entry in entries
        ]

    def _published(self, requests: Sequence[tuple[str, str]]) -> dict[str, list[ReplyMessage]]:
        """(request id, reply stream) -> the replies already published for each request, as
        published_history gives them (None: incomplete)."""
        streams = sorted({stream for _, stream in requests if stream})
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xrange(stream, "-", "+")
        found: dict[str, list[ReplyMessage]] = {request_id: [] for request_id, _ in requests}
        for entries in pipe.execute() if streams else []:
            for _, fields in entries:
                try:
                    replies = decode_replies(fields)
                except ProtocolError:
                    continue
                for reply in replies:
                    if reply.request_id in found:
                        found[reply.request_id].append(reply)
        return {request_id: published_history(replies) for request_id, replies in found.items()}

    def dead_letter(self, entry: Entry, reason: str) -> None:
        fields = {**entry.fields, "entry_id": entry.entry_id, "reason": reason}
        stream = self.keys.dead_letters
        self.client.xadd(stream, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)

    def forget_gateways(self, gateway_ids: Sequence[str], reply_streams: Sequence[str]) -> None:
        """A gateway gone for good: its heartbeat and its reply stream go."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(self.keys.gateways, *gateway_ids)
        pipe.delete(*reply_streams)
        pipe.execute()

    def forget_consumers(self, consumers: Sequence[str]) -> None:
        """Dead consumers with nothing pending (worker ids are per process: they add up)."""
        for queue in self.queues:
            for consumer in consumers:
                # Only with nothing pending: DELCONSUMER drops a consumer's pending entries.
                pending = self.client.xpending_range(
                    queue, WORKER_GROUP, "-", "+", 1, consumername=consumer
                )
                if not pending:
                    self.client.xgroup_delconsumer(queue, WORKER_GROUP, consumer)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _request_id(fields: Fields) -> str:
    """The request id of an entry without validating the rest (the service decodes it)."""
    return _addressing(fields)[0]


def _addressing(fields: Fields) -> tuple[str, str]:
    """(request id, reply stream) of an entry without validating the rest ("" when absent)."""
    try:
        message = json.loads(fields[b"m"])
        return str(message["request_id"]), str(message.get("reply_to") or "")
    except (KeyError, TypeError, ValueError, AttributeError):
        return "", ""


def _entries(reply: object) -> list[Entry]:
    """XREAD/XREADGROUP reply -> its entries, each with its stream."""
    if isinstance(reply, dict):  # RESP3: {stream: [[(id, fields), ...]]}
        batches = [(_text(s), batch) for s, value in reply.items() for batch in value]
    else:  # RESP2: [[stream, [(id, fields), ...]]]
        batches = [(_text(s[0]), s[1]) for s in reply or []]  # type: ignore[index]
    return [
        Entry(i.decode(), fields or {}, stream) for stream, batch in batches for i, fields in batch
    ]


def entry_cost(fields: Fields) -> int:
    """The tokens a request entry was charged for fair share (`c`; 0 when absent)."""
    try:
        return max(int(fields.get(b"c", 0)), 0)
    except ValueError:
        return 0


def _field_map(flat: list[bytes]) -> Fields:
    """A stream entry's fields as Lua returns them (flat) -> a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _unless_no_group(results: list[object]) -> list[list[dict]]:
    """Pipelined replies about several queues' group (XPENDING, XINFO CONSUMERS): a queue
    without the group (Redis restarted empty) has nothing in it; any other error is raised."""
    out = []
    for result in results:
        if isinstance(result, redis.ResponseError):
            if "NOGROUP" not in str(result) and "no such key" not in str(result):
                raise result
            result = []
        out.append(result)
    return out  # type: ignore[return-value]
