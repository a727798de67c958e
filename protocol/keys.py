"""The wire protocol's Redis side: every key name, the timing constants, where Redis is.

Nothing outside `protocol/` spells a key name.

Keys (prefix `jitney` by default, so several deployments can share one Redis):
- `{p}:requests`            stream of RequestMessage; consumer group `workers`. A worker XACKs
                            and XDELs an entry with its final reply, so the stream holds only
                            queued and in-progress requests
- `{p}:dead`                stream of dead-lettered requests (failed MAX_DELIVERIES times)
- `{p}:fenced:{worker}`     a flag: another worker judged this one dead and took its requests
- `{p}:replies:{gateway}`   stream of the replies to the requests one gateway enqueued: an entry
                            holds one worker step's replies for that gateway (a batch). It is
                            also the record a worker taking a request over continues from, so the
                            gateway trims only what it read of requests no longer in flight
- `{p}:cancels`             stream of CancelMessage; every worker reads all of it
- `{p}:cancelled:{id}`      a flag with a TTL, so a worker can drop a queued entry before prefill
- `{p}:workers`             sorted set worker id -> last heartbeat (unix seconds):
                            the worker's lease on the requests it holds
- `{p}:gateways`            sorted set gateway id -> last heartbeat (unix seconds)
- `{p}:models`              set of the model names with a published card
- `{p}:model:{name}`        hash: ModelCard published by the workers serving that model
- `{p}:queued_tokens`       prompt tokens of entries no worker has read yet (all gateways)
- `{p}:live:{worker}`       a worker's live batch view (protocol/snapshot.py), JSON, expiring
                            with its lease (HEARTBEAT_TTL_S)
- `{p}:ratelimit:{key_id}`  a token bucket per API key (gateway rate limits)
- `{p}:file:{id}`           hash: a Batch API file's object (JSON), input or output
- `{p}:file_lines:{id}`     list: that file's JSONL lines
- `{p}:batches`             sorted set batch id -> created_at: every batch (the list route)
- `{p}:batches:active`      sorted set batch id -> created_at: batches with work left for the
                            gateways' runners (in progress, cancelling, finalizing)
- `{p}:batch:{id}`          hash: a batch's state (status, counts, times, next line to claim)
- `{p}:batch_leases:{id}`   sorted set line index -> lease expiry (unix seconds): lines a gateway
                            is running; an expired lease is claimed again by any gateway
- `{p}:batch_results:{id}`  hash line index -> its output line, written once (HSETNX)

Reply seq contract: replies of one request carry seq 0, 1, 2, ... with no gaps, whichever worker
sends them; a worker that takes a request over continues after the replies already published
for it (read back from its gateway's reply stream).
Delivery is at-least-once, so a gateway drops a reply whose seq it has already delivered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
WORKER_GROUP = "workers"
# A worker or gateway whose heartbeat is older than this is gone (hosts' clocks must agree to
# well within it: NTP).
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5.0
# A request delivered (read or taken over) more than this many times is dead-lettered.
MAX_DELIVERIES = 3
DEAD_LETTER_MAXLEN = 10_000
FENCE_TTL_S = 3600
# The consumer that holds handed-back entries until a live worker takes them over. It never
# heartbeats, so its entries always count as orphaned.
RELEASED_CONSUMER = "released"
# How long a cancel flag outlives the cancel (long enough for any queued entry to be read).
CANCEL_FLAG_TTL_S = 3600
# A safety net on a reply stream's length (one entry per worker step for that gateway): its
# gateway trims it itself, keeping the replies of requests in flight (a takeover reads them).
REPLY_STREAM_MAXLEN = 1_000_000
CANCEL_STREAM_MAXLEN = 10_000


def redis_url() -> str:
    """The one place REDIS_URL is read (password and TLS go in the URL: rediss://:pw@host)."""
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def redacted(url: str) -> str:
    """The URL without its credentials, for logs (Sentinel URLs list several hosts)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "jitney"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    def replies(self, gateway_id: str) -> str:
        return f"{self.prefix}:replies:{gateway_id}"

    @property
    def cancels(self) -> str:
        return f"{self.prefix}:cancels"

    def cancelled(self, request_id: str) -> str:
        return f"{self.prefix}:cancelled:{request_id}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def gateways(self) -> str:
        return f"{self.prefix}:gateways"

    @property
    def models(self) -> str:
        return f"{self.prefix}:models"

    def model(self, name: str) -> str:
        return f"{self.prefix}:model:{name}"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    def fenced(self, worker_id: str) -> str:
        return f"{self.prefix}:fenced:{worker_id}"

    @property
    def queued_tokens(self) -> str:
        return f"{self.prefix}:queued_tokens"

    def live_batch(self, worker_id: str) -> str:
        return f"{self.prefix}:live:{worker_id}"

    def ratelimit(self, key_id: str) -> str:
        return f"{self.prefix}:ratelimit:{key_id}"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        return f"{self.prefix}:file_lines:{file_id}"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def active_batches(self) -> str:
        return f"{self.prefix}:batches:active"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def batch_leases(self, batch_id: str) -> str:
        return f"{self.prefix}:batch_leases:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        return f"{self.prefix}:batch_results:{batch_id}"
