"""Prefix-aware placement: enqueue a request where its prompt's start is already cached.

Workers publish what their prefix caches hold (worker/prefix_summary.py). Per request this
module hashes the prompt's full blocks with the workers' own function (generation/block_hash.py),
asks every live worker's summary how many leading blocks it holds, and enqueues into the chosen
worker's own stream of the request's queue, or into the shared stream as without placement
(protocol/queue/placement.py; one LOOKUP, then one PLACE). It never strands work: the owner
reads its own stream with the shared one, and any worker takes what the owner has not read
within the steal bound.

The rule (`choose`), with a worker's *lead* = unread entries in its own stream of the queue +
requests it read and has not admitted - requests it could start now (below 0: it has room):
0. Adapter: a request under a LoRA adapter that some live workers hold resident and others do
   not goes to one that holds it (reading an adapter's files costs about what a long prefill
   does): the one holding the most leading blocks among them (ties: the smaller lead), if it
   has room, or if nobody has and it is at most BUSY_SLACK requests further behind than the
   least busy worker. Else (busy): the shared stream, where any worker takes it, loading the
   adapter. When every worker holds it, or none does, the adapter says nothing: steps 1-4.
1. The candidate is the worker holding the most leading blocks (ties: the smaller lead).
2. No useful hit (shared): it holds fewer than MIN_GAIN_BLOCKS blocks more than the worker
   holding the fewest. What every worker holds (a chat template's header, a system prompt all
   of them have seen) says nothing about where to go, and the shared stream keeps the load even.
3. Hit: it has room (lead < 0): it starts the request within a step, and skips those blocks'
   prefill.
4. Otherwise it is busy. It still gets the request when nobody has room and it is at most
   BUSY_SLACK requests further behind than the least busy worker, but only for a hit covering
   at least LONG_HIT_SHARE of the prompt: waiting about one request longer is worth skipping
   most of a long prefill, not a short one. Else (busy): the shared stream, where whoever frees
   a seat first takes it.
A prompt under an adapter is looked up however short it is; a base model's prompt shorter than a
block is not (no hit to find). Placing costs the gateway the hashing (blake2b over the prompt's
tokens), and Redis one LOOKUP (an HMGET and an XINFO per live worker) and one PLACE instead of
the plain enqueue; the live workers' list and block size are read at most every FLEET_REFRESH_S
(docs/scale.md).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.serving.shared_fetch import SharedFetch
from generation.block_hash import prompt_block_hashes, summary_hash
from protocol import HEARTBEAT_TTL_S, Keys
from protocol.queue import Queue, scripts
from protocol.queue.calls import lookup_call, place_call
from protocol.queue.placement import BLOCK_SIZE_FIELD, Cached, lookup_reply

# A prompt is compared on its first this many blocks (8,192 tokens at 16 a block): beyond them
# hits rarely differ, and LOOKUP's cost grows with them.
MAX_LOOKUP_BLOCKS = 512
MIN_GAIN_BLOCKS = 1  # over the worker holding the fewest: less says nothing about where to go
BUSY_SLACK = 1  # requests further behind than the least busy worker a long hit may wait
LONG_HIT_SHARE = 0.5  # of the prompt's blocks: what is worth waiting a request longer for
FLEET_REFRESH_S = 0.5  # a new worker is placed on within this long; a dead one's summary is gone
OUTCOMES = ("hit", "no_hit", "busy", "adapter")


@dataclass(frozen=True, slots=True)
class Fleet:
    """The model's live workers that publish a summary, and the block size they hash in."""

    workers: tuple[str, ...]
    block_size: int


def lead(worker: Cached) -> int:
    """Requests before this one could start on `worker` (below 0: it has room now)."""
    return worker.unread + worker.waiting - worker.room


def choose(cached: Sequence[Cached], prompt_blocks: int) -> tuple[str, Cached | None]:
    """The rule above: (outcome, the worker to place on, or None for the shared stream)."""
    if len(cached) < 2:
        return "no_hit", None
    holders = [c for c in cached if c.adapter]
    if holders and len(holders) < len(cached):
        return _by_adapter(holders, cached)
    best = max(cached, key=lambda c: (c.blocks, -lead(c)))
    gain = best.blocks - min(c.blocks for c in cached)
    if gain < MIN_GAIN_BLOCKS:
        return "no_hit", None
    if lead(best) < 0:
        return "hit", best
    least = min(lead(c) for c in cached)
    long_hit = gain >= LONG_HIT_SHARE * prompt_blocks
    if least >= 0 and long_hit and lead(best) <= least + BUSY_SLACK:
        return "hit", best
    return "busy", None


def _by_adapter(holders: Sequence[Cached], cached: Sequence[Cached]) -> tuple[str, Cached | None]:
    """Step 0: the holder of the request's adapter with the longest prefix, unless busy."""
    best = max(holders, key=lambda c: (c.blocks, -lead(c)))
    least = min(lead(c) for c in cached)
    if lead(best) < 0 or (least >= 0 and lead(best) <= least + BUSY_SLACK):
        return "adapter", best
    return "busy", None


class Placement:
    """One model's placement (BacklogMonitor holds it when `--prefix-placement` is on)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, count: Callable[[str], None]):
        self.redis = redis
        self.keys = keys
        self.model = model
        self.count = count  # one request's outcome (one of OUTCOMES): the gateway's metric
        self._lookup = redis.register_script(scripts.LOOKUP)
        self._place = redis.register_script(scripts.PLACE)
        self._fleet: Fleet | None = None
        self._fleet_at = -float("inf")
        self._fetching = SharedFetch(self._read_fleet)

    async def target(
        self, queue: Queue, prompt_ids: Sequence[int], adapter: str | None = None
    ) -> str | None:
        """The worker to place a prompt on (None: the shared stream); counts the outcome.
        `adapter`: the LoRA adapter it runs under, part of its blocks' hashes as on the worker."""
        fleet = await self.fleet()
        outcome, worker = "no_hit", None
        long_enough = len(prompt_ids) >= fleet.block_size * MIN_GAIN_BLOCKS
        if len(fleet.workers) >= 2 and (long_enough or adapter is not None):
            blocks = prompt_block_hashes(prompt_ids, fleet.block_size, MAX_LOOKUP_BLOCKS, adapter)
            hashes = [summary_hash(h) for h in blocks]
            call = lookup_call(self.keys, self.model, queue, fleet.workers, hashes, adapter)
            reply = await self._lookup(keys=call.keys, args=call.args)
            outcome, chosen = choose(lookup_reply(fleet.workers, reply), len(blocks))
            worker = None if chosen is None else chosen.worker
        self.count(outcome)
        return worker

    async def place(
        self, worker: str, queue: Queue, fields: dict[str, str], prompt_tokens: int
    ) -> tuple[str, str]:
        """PLACE an entry on `worker` (the shared stream if its summary is gone by now):
        (stream, entry id)."""
        call = place_call(self.keys, self.model, queue, worker, fields, prompt_tokens)
        stream, entry_id = await self._place(keys=call.keys, args=call.args)
        return _text(stream), _text(entry_id)

    async def fleet(self) -> Fleet:
        """The live workers with a summary, read at most every FLEET_REFRESH_S (concurrent
        callers share one reading)."""
        if self._fleet is not None and time.monotonic() - self._fleet_at < FLEET_REFRESH_S:
            return self._fleet
        return await self._fetching()

    async def _read_fleet(self) -> Fleet:
        now = time.time()
        live = await self.redis.zrangebyscore(
            self.keys.model_workers(self.model), now - HEARTBEAT_TTL_S, "+inf"
        )
        workers = [_text(w) for w in live]
        pipe = self.redis.pipeline(transaction=False)
        for worker in workers:
            pipe.hget(self.keys.prefix_summary(worker), BLOCK_SIZE_FIELD)
        sizes = await pipe.execute() if workers else []
        by_size = Counter(int(s) for s in sizes if s is not None)
        block_size = by_size.most_common(1)[0][0] if by_size else 1
        summarized = tuple(
            w for w, s in zip(workers, sizes, strict=True) if s is not None and int(s) == block_size
        )
        self._fleet, self._fleet_at = Fleet(summarized, block_size), time.monotonic()
        return self._fleet


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
