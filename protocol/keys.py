"""The wire protocol's Redis side: every key name, the timing constants, where Redis is.

Nothing outside `protocol/` spells a key name.

Keys (prefix `jitney` by default, so several deployments can share one Redis). `{p}` is the
prefix as a Redis Cluster hash tag, `{jitney}`: every key of a deployment lives in one cluster
slot, so each Lua script and MULTI touches one shard. A deployment is the unit of sharding (docs/
scale.md); a prefix that already holds a `{tag}` is used as it is.
- `{p}:requests:{model}`    the default request queue of one served model: a stream of
                            RequestMessage, consumer group `workers` (the workers serving that
                            model). A worker XACKs and XDELs an entry with its final reply, so a
                            queue holds only queued and in-progress requests. Each entry also
                            carries `c`, its cost in tokens (prompt + max_tokens), for fair share
- `{p}:requests:{model}:p{priority}[:k:{key id}]` the queue of one priority, and of one API key
                            with a fair-share weight; priority 0 without a key is the default
- `{queue}:w:{worker}`      a worker's own stream of a queue (prefix-aware placement): requests
                            a gateway placed there because that worker's prefix cache holds
                            their prompt's start. Listed in the queue set like any queue; any
                            other worker of the model takes an entry the owner has not read
                            within the bound (protocol/queue/placement.py)
- `{p}:queue_owners:{model}` hash own stream -> its worker id (which listed queues are whose)
- `{p}:prefix:{worker}`     hash: a worker's prefix summary, expiring with its lease: a field per
                            block hash its prefix cache holds (the hash's first 8 bytes, value
                            empty), and its load (`room`, `waiting`, `block_size`: names of
                            another length, so never a block's)
- `{p}:queues:{model}`      sorted set queue stream -> priority: every queue of the model, read
                            most urgent first (protocol/queue/scripts.py, READ)
- `{p}:queue_weights:{model}` hash queue stream -> its key's weight (1 when it has none)
- `{p}:queue_deficits:{model}` hash queue stream -> its deficit in tokens (deficit round robin
                            between the queues of one priority)
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
- `{p}:model_workers:{model}` sorted set worker id -> last heartbeat, of that model's workers
                            (gateways serve a model only while one of its workers is live)
- `{p}:gateways`            sorted set gateway id -> last heartbeat (unix seconds)
- `{p}:models`              set of the model names with a published card
- `{p}:model:{name}`        hash: ModelCard published by the workers serving that model
- `{p}:queued_tokens:{model}` prompt tokens of that model's entries no worker has read yet
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
- `{p}:response:{id}`       hash: a stored Responses API response (`owner`: the API key id, `body`:
                            the response object, `conversation`: its input and output items, for
                            previous_response_id), expiring after the gateway's --responses-ttl

Reply seq contract: replies of one request carry seq 0, 1, 2, ... with no gaps, whichever worker
sends them; a worker that takes a request over continues after the replies already published
for it (read back from its gateway's reply stream).
Delivery is at-least-once, so a gateway drops a reply whose seq it has already delivered.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

# What `from protocol import ...` gets of this module (protocol/__init__.py star-imports it).
__all__ = [
    "CANCEL_FLAG_TTL_S",
    "CANCEL_STREAM_MAXLEN",
    "DEAD_LETTER_MAXLEN",
    "DEFAULT_REDIS_URL",
    "FENCE_TTL_S",
    "HEARTBEAT_INTERVAL_S",
    "HEARTBEAT_TTL_S",
    "MAX_DELIVERIES",
    "RELEASED_CONSUMER",
    "REPLY_STREAM_MAXLEN",
    "WORKER_GROUP",
    "Keys",
    "redacted",
    "redis_url",
]

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
    # The prefix as a cluster hash tag (see the module docstring); computed once.
    tag: str = field(init=False)

    def __post_init__(self) -> None:
        tagged = re.search(r"\{[^}]+\}", self.prefix) is not None
        object.__setattr__(self, "tag", self.prefix if tagged else f"{{{self.prefix}}}")

    def requests(
        self, model: str, priority: int = 0, share: str | None = None, worker: str | None = None
    ) -> str:
        """The queue of `model` at `priority`, of API key `share` (one with a fair-share weight)
        or of every other request at that priority; `worker`'s own stream of it if given."""
        name = f"{self.tag}:requests:{model}"
        if priority or share:
            name += f":p{priority}"
        if share:
            name += f":k:{share}"
        return name + self.own_suffix(worker) if worker else name

    @staticmethod
    def own_suffix(worker: str) -> str:
        """What a worker's own stream of a queue adds to the queue's name."""
        return f":w:{worker}"

    def queue_owners(self, model: str) -> str:
        return f"{self.tag}:queue_owners:{model}"

    def prefix_summary(self, worker_id: str) -> str:
        return f"{self.tag}:prefix:{worker_id}"

    def queues(self, model: str) -> str:
        return f"{self.tag}:queues:{model}"

    def queue_weights(self, model: str) -> str:
        return f"{self.tag}:queue_weights:{model}"

    def queue_deficits(self, model: str) -> str:
        return f"{self.tag}:queue_deficits:{model}"

    def replies(self, gateway_id: str) -> str:
        return f"{self.tag}:replies:{gateway_id}"

    @property
    def cancels(self) -> str:
        return f"{self.tag}:cancels"

    def cancelled(self, request_id: str) -> str:
        return f"{self.tag}:cancelled:{request_id}"

    @property
    def workers(self) -> str:
        return f"{self.tag}:workers"

    def model_workers(self, model: str) -> str:
        return f"{self.tag}:model_workers:{model}"

    @property
    def gateways(self) -> str:
        return f"{self.tag}:gateways"

    @property
    def models(self) -> str:
        return f"{self.tag}:models"

    def model(self, name: str) -> str:
        return f"{self.tag}:model:{name}"

    def lora_adapters(self, model: str) -> str:
        """The LoRA adapters loaded at runtime for `model` (protocol/lora_registry.py)."""
        return f"{self.tag}:lora_adapters:{model}"

    @property
    def dead_letters(self) -> str:
        return f"{self.tag}:dead"

    def fenced(self, worker_id: str) -> str:
        return f"{self.tag}:fenced:{worker_id}"

    def queued_tokens(self, model: str) -> str:
        return f"{self.tag}:queued_tokens:{model}"

    def live_batch(self, worker_id: str) -> str:
        return f"{self.tag}:live:{worker_id}"

    def ratelimit(self, key_id: str) -> str:
        return f"{self.tag}:ratelimit:{key_id}"

    def file(self, file_id: str) -> str:
        return f"{self.tag}:file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        return f"{self.tag}:file_lines:{file_id}"

    @property
    def batches(self) -> str:
        return f"{self.tag}:batches"

    @property
    def active_batches(self) -> str:
        return f"{self.tag}:batches:active"

    def batch(self, batch_id: str) -> str:
        return f"{self.tag}:batch:{batch_id}"

    def batch_leases(self, batch_id: str) -> str:
        return f"{self.tag}:batch_leases:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        return f"{self.tag}:batch_results:{batch_id}"

    def response(self, response_id: str) -> str:
        return f"{self.tag}:response:{response_id}"
