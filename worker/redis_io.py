"""The worker's Redis calls, one method per round trip, so the engine loop reads as steps.

Pure I/O: decoding, validation and logging are the service's. Every key comes from
`jitney.protocol.Keys`. Methods raise redis' ConnectionError/TimeoutError; the loop retries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from jitney.protocol import REPLY_STREAM_MAXLEN, WORKER_GROUP, Keys, ModelCard, ReplyMessage

# A blocking read must return before the socket times out (redis-py raises TimeoutError then).
SOCKET_TIMEOUT_MARGIN_S = 5.0
MAX_CANCELS_PER_READ = 1000

Fields = dict[bytes, bytes]


@dataclass(slots=True)
class Entry:
    entry_id: str
    fields: Fields


@dataclass(slots=True)
class Outbox:
    """Replies and acks of one step, published in one pipelined round trip.

    Kept until a publish succeeds: a failed publish is retried whole (the gateway drops the
    duplicates by seq; XACK is idempotent), so no delta is lost while Redis is away.
    """

    replies: list[tuple[str, ReplyMessage]] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.replies or self.acks)


class WorkerRedis:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str):
        self.client = client
        self.keys = keys
        self.worker_id = worker_id

    @classmethod
    def connect(cls, url: str, keys: Keys, worker_id: str, idle_block_ms: int) -> WorkerRedis:
        client = redis.Redis.from_url(
            url,
            socket_timeout=idle_block_ms / 1000 + SOCKET_TIMEOUT_MARGIN_S,
            socket_connect_timeout=2.0,
        )
        return cls(client, keys, worker_id)

    # ----- joining and leaving -------------------------------------------------------------
    def ensure_group(self) -> None:
        """Create the consumer group (and the stream). From id 0: entries a gateway queued
        before any worker existed are served, not skipped."""
        try:
            self.client.xgroup_create(self.keys.requests, WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def last_cancel_id(self) -> str:
        """Where to start reading cancels: after the newest one now (a non-blocking XREAD
        from "$" would never return anything)."""
        newest = self.client.xrevrange(self.keys.cancels, count=1)
        return newest[0][0].decode() if newest else "0-0"

    def heartbeat(self, card: ModelCard) -> None:
        """Refresh this worker's heartbeat; publish the model card if it is missing (first
        heartbeat, or a Redis restart lost it). One round trip unless the card is missing."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.keys.workers, {self.worker_id: time.time()})
        pipe.exists(self.keys.model(card.name))
        _, has_card = pipe.execute()
        if not has_card:
            self.publish_card(card)

    def publish_card(self, card: ModelCard) -> None:
        self.client.hset(self.keys.model(card.name), mapping=card.encode())

    def leave(self) -> None:
        self.client.zrem(self.keys.workers, self.worker_id)

    # ----- the loop ------------------------------------------------------------------------
    def read_cancels(self, after: str) -> list[Entry]:
        reply = self.client.xread({self.keys.cancels: after}, count=MAX_CANCELS_PER_READ)
        return _entries(reply)

    def read_requests(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` new entries for this consumer; block only when `block_ms` is set."""
        try:
            reply = self.client.xreadgroup(
                WORKER_GROUP, self.worker_id, {self.keys.requests: ">"}, count=count, block=block_ms
            )
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_group()  # Redis restarted without persistence: the group is gone
            return []
        return _entries(reply)

    def cancel_flags(self, request_ids: Sequence[str]) -> list[bool]:
        """Which of these requests were cancelled while queued (one round trip)."""
        if not request_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(self.keys.cancelled(request_id))
        return [bool(n) for n in pipe.execute()]

    def publish(self, outbox: Outbox) -> None:
        pipe = self.client.pipeline(transaction=False)
        for stream, reply in outbox.replies:
            pipe.xadd(stream, reply.encode(), maxlen=REPLY_STREAM_MAXLEN, approximate=True)
        if outbox.acks:
            pipe.xack(self.keys.requests, WORKER_GROUP, *outbox.acks)
        pipe.execute()


def _entries(reply: object) -> list[Entry]:
    """XREAD/XREADGROUP reply of one stream -> its entries."""
    if isinstance(reply, dict):  # RESP3: {stream: [[(id, fields), ...]]}
        batches = [batch for value in reply.values() for batch in value]
    else:  # RESP2: [[stream, [(id, fields), ...]]]
        batches = [stream[1] for stream in reply or []]  # type: ignore[attr-defined]
    return [Entry(i.decode(), fields or {}) for batch in batches for i, fields in batch]
