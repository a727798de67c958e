"""The worker's Redis calls, one method per round trip, so the engine loop reads as steps.

Pure I/O: the scripts, their KEYS and ARGV and the entry fields are the queue contract's
(protocol/queue); decoding, validation and logging are the engine loop's. Every key comes from
`protocol.Keys`. Methods raise redis' ConnectionError/TimeoutError; the loop retries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import redis

from protocol import (
    DEAD_LETTER_MAXLEN,
    FENCE_TTL_S,
    RELEASED_CONSUMER,
    WORKER_GROUP,
    Keys,
    ModelCard,
    ProtocolError,
    ReplyMessage,
    decode_replies,
)
from protocol.queue import (
    Addressing,
    Fields,
    addressing,
    dead_letter_fields,
    heartbeat_call,
    publish_call,
    read_call,
    read_reply,
    scripts,
)
from protocol.queue.placement import (
    BLOCK_SIZE_FIELD,
    ROOM_FIELD,
    STEAL_AFTER_MS,
    SUMMARY_TTL_MS,
    SummaryUpdate,
    placed_read_reply,
)
from protocol.redis_client import sync_client

# A blocking read must return before the socket times out (redis-py raises TimeoutError then).
SOCKET_TIMEOUT_MARGIN_S = 5.0
MAX_CANCELS_PER_READ = 1000
# Handed-back entries are marked idle this long, so any claimer's min-idle test passes at once.
RELEASED_IDLE_MS = 24 * 3600 * 1000

# While a model has one queue, reads skip the script but for one every this often (to find a
# first queue of another priority).
LIST_QUEUES_S = 0.5
# With placement: how often a read also looks at other workers' own streams for entries to take
# (sooner when the last look said one becomes takeable sooner).
STEAL_CHECK_S = 0.25


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
    summary: SummaryUpdate | None = None  # the prefix summary's changes (placement)

    def __bool__(self) -> bool:
        return bool(self.replies or self.acks or self.refunds or self.summary)


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


class PublishResult(IntEnum):
    """What `WorkerRedis.publish` did: the PUBLISH script's return value (protocol/queue)."""

    FENCED = 0  # nothing written: another worker took this one's requests over
    APPLIED = 1
    SUMMARY_LOST = 2  # applied, but the prefix summary was gone (Redis lost it): send it afresh


class WorkerRedis:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        worker_id: str,
        model: str,
        placement: bool = False,
        steal_after_ms: int = STEAL_AFTER_MS,
    ):
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
        # Each runs every step or second: registered once, called by SHA (scripts.py).
        # Prefix-aware placement: this worker publishes a summary, has own streams, and reads
        # them with the shared ones (protocol/queue/placement.py).
        self.placement = placement
        self.steal_after_ms = steal_after_ms
        self.summary_key = keys.prefix_summary(worker_id)
        self.own_suffix = keys.own_suffix(worker_id)
        self.owned: dict[str, str] = {}  # own streams (any worker's) -> their queue, as last read
        # Redis lost the summary and own streams (a restart: the heartbeat found the card gone,
        # or a publish found the summary gone): the loop joins placement again. Set by the
        # heartbeat thread, cleared by the loop.
        self.placement_lost = False
        self._steal_at = 0.0  # monotonic: when a read next looks at others' own streams
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._publish = client.register_script(scripts.PUBLISH)
        self._read = client.register_script(scripts.READ)

    @classmethod
    def connect(
        cls,
        url: str,
        keys: Keys,
        worker_id: str,
        model: str,
        idle_block_ms: int,
        placement: bool = False,
        steal_after_ms: int = STEAL_AFTER_MS,
    ) -> WorkerRedis:
        client = sync_client(
            url,
            socket_timeout=idle_block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
            socket_connect_timeout=2.0,
        )
        return cls(client, keys, worker_id, model, placement, steal_after_ms)

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
        ttl_ms = SUMMARY_TTL_MS if self.placement else 0
        call = heartbeat_call(self.keys, self.worker_id, self.model, card.name, time.time(), ttl_ms)
        renewed, has_card = self._heartbeat(keys=call.keys, args=call.args)
        if not has_card:
            self.publish_card(card)
            self.placement_lost = self.placement
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

    def join_placement(self, block_size: int) -> None:
        """Start an empty prefix summary (the loop's first publish fills it; gateways count
        this worker in from now) and make this worker's own stream of the default queue,
        listed, so its idle wait covers it from the start: the summary first, or another
        worker's read would drop the ownerless stream."""
        own = self.keys.requests(self.model, worker=self.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.summary_key)
        pipe.hset(self.summary_key, mapping={ROOM_FIELD: 0, BLOCK_SIZE_FIELD: block_size})
        pipe.pexpire(self.summary_key, SUMMARY_TTL_MS)
        pipe.zadd(self.keys.queues(self.model), {own: 0})
        pipe.hset(self.keys.queue_owners(self.model), own, self.worker_id)
        pipe.xgroup_create(own, WORKER_GROUP, id="0", mkstream=True)
        for result in pipe.execute(raise_on_error=False):
            if isinstance(result, redis.ResponseError) and "BUSYGROUP" not in str(result):
                raise result

    def withdraw_summary(self) -> None:
        """No more placements here (leaving): gateways stop placing, and others may take what
        waits in this worker's own streams at once."""
        self.client.delete(self.summary_key)

    def leave(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(self.keys.workers, self.worker_id)
        pipe.zrem(self.model_workers, self.worker_id)
        if self.placement:
            pipe.delete(self.summary_key)
        pipe.execute()

    # ----- the loop ------------------------------------------------------------------------
    def read_cancels(self, after: str) -> list[Entry]:
        reply = self.client.xread({self.keys.cancels: after}, count=MAX_CANCELS_PER_READ)
        return _entries(reply)

    def read_requests(
        self, count: int, block_ms: int | None, below: int | None = None
    ) -> list[Entry]:
        """Up to `count` new entries for this consumer, most urgent first, fair between the
        queues of one priority (scripts.READ). Only entries more urgent than `below`, when
        given. With `block_ms`, and nothing there, wait that long for an entry of any queue.

        While the model has only its default queue (as the script last said: it runs at least
        every LIST_QUEUES_S), a plain XREADGROUP does, as before queues per priority existed;
        a first queue of another priority is seen within that interval."""
        now = time.monotonic()
        if self.placement:
            return self._read_placed(count, block_ms, below, now)
        if below is None and len(self.queues) == 1 and now < self._list_queues_at:
            return self._read_default(count, block_ms)
        self._list_queues_at = now + LIST_QUEUES_S
        call = read_call(self.keys, self.model, self.worker_id, count, below)
        reply = read_reply(self._read(keys=call.keys, args=call.args))
        self.queues = reply.queues
        entries = [Entry(entry_id, fields, queue) for queue, entry_id, fields in reply.entries]
        if entries or not block_ms or below is not None:
            return entries
        # Nothing waiting: block on every queue at once (one entry each at most; an idle or
        # nearly idle worker has room for them). A queue made during the wait is seen at the
        # next read, within block_ms.
        return self._xreadgroup(dict.fromkeys(self.queues, ">"), 1, block_ms)

    def _read_placed(
        self, count: int, block_ms: int | None, below: int | None, now: float
    ) -> list[Entry]:
        """The read with own streams (scripts.READ with placement): the script every time; it
        looks at other workers' own streams every STEAL_CHECK_S, or when one of their entries
        becomes takeable. Idle, it blocks on its own and the shared streams only (others' are
        not its to read at once), no longer than until the next look."""
        steal = now >= self._steal_at
        call = read_call(
            self.keys, self.model, self.worker_id, count, below, True, steal, self.steal_after_ms
        )
        raw = self._read(keys=call.keys, args=call.args)
        reply, placed = read_reply(raw), placed_read_reply(raw[2:])
        self.queues, self.owned = reply.queues, placed.owned
        if steal:
            wait_s = STEAL_CHECK_S if placed.steal_in_ms is None else placed.steal_in_ms / 1000
            self._steal_at = now + min(wait_s, STEAL_CHECK_S)
        entries = [Entry(entry_id, fields, queue) for queue, entry_id, fields in reply.entries]
        if entries or not block_ms or below is not None:
            return entries
        mine = [q for q in self.queues if self.placement_outcome(q) != "stolen"]
        if len(mine) < len(self.queues):  # others' streams exist: look again in time
            block_ms = max(1, min(block_ms, int(1000 * (self._steal_at - time.monotonic()))))
        return self._xreadgroup(dict.fromkeys(mine, ">"), 1, block_ms)

    def queue_of(self, stream: str) -> str:
        """The queue a stream is of: itself, or the queue an own stream belongs to."""
        return self.owned.get(stream, stream)

    def placement_outcome(self, stream: str) -> str:
        """How an entry read from `stream` got here: its own stream ("own"), another worker's
        ("stolen"), or the queue's shared one ("shared")."""
        queue = self.owned.get(stream)
        if queue is None:
            return "shared"
        return "own" if stream == queue + self.own_suffix else "stolen"

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

    def publish(self, outbox: Outbox) -> PublishResult:
        """Apply one step's writes atomically (unless this worker is fenced)."""
        call = publish_call(
            self.keys,
            self.worker_id,
            self.model,
            outbox.replies,
            outbox.gone_streams,
            outbox.acks,
            [(self.queue_of(queue), tokens) for queue, tokens in outbox.refunds],
            outbox.summary,
        )
        return PublishResult(int(self._publish(keys=call.keys, args=call.args)))

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
        addresses = [addressing(entry.fields) for entry in entries]
        published = self._published(addresses)
        return [
            Claimed(entry, times[entry.ref] + 1, published.get(address.request_id))
            for entry, address in zip(entries, addresses, strict=True)
        ]

    def _published(self, requests: Sequence[Addressing]) -> dict[str, list[ReplyMessage]]:
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
        fields = dead_letter_fields(entry.fields, entry.entry_id, reason)
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


def _entries(reply: object) -> list[Entry]:
    """XREAD/XREADGROUP reply -> its entries, each with its stream."""
    if isinstance(reply, dict):  # RESP3: {stream: [[(id, fields), ...]]}
        batches = [(_text(s), batch) for s, value in reply.items() for batch in value]
    else:  # RESP2: [[stream, [(id, fields), ...]]]
        batches = [(_text(s[0]), s[1]) for s in reply or []]  # type: ignore[index]
    return [
        Entry(i.decode(), fields or {}, stream) for stream, batch in batches for i, fields in batch
    ]


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
