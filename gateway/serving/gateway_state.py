"""The gateway's shared state and background work: Redis client, reply reader, heartbeat, cancels.

One `Gateway` per process (per aiohttp app). It owns:
- the Redis client, with every call bounded by a socket timeout and one quick retry (a restarted
  Redis is reconnected by redis-py on the next call);
- the ReplyRouter (one reader task), the BacklogMonitor and the ModelRegistry;
- the heartbeat in `keys.gateways`, which workers use to abort requests of a dead gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.serving.backlog import Backlog, BacklogMonitor, ModelBacklogs
from gateway.serving.gateway_metrics import GatewayMetrics
from gateway.serving.reply_router import ReplyRouter
from gateway.serving.served_models import ModelRegistry
from gateway.serving.tasks import cancel_and_wait
from protocol import (
    CANCEL_FLAG_TTL_S,
    CANCEL_STREAM_MAXLEN,
    HEARTBEAT_INTERVAL_S,
    CancelMessage,
    Keys,
)
from protocol.redis_client import async_client

log = logging.getLogger(__name__)

# Gateway heartbeats older than this are pruned (ids are per process, so the set would only grow).
STALE_GATEWAY_S = 3600.0


def make_redis(config: GatewayConfig) -> aioredis.Redis:
    # A blocking pool (plain URLs): under a burst, handlers wait (up to the Redis timeout) for
    # one of a bounded set of connections instead of failing with "Too many connections".
    return async_client(
        config.redis_url,
        max_connections=config.redis_max_connections,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
        # One retry covers a connection Redis closed on restart; more would stretch a 503
        # into a hang (redis-py's default is 10 retries with backoff up to 10 s).
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.02), 1),
        health_check_interval=10,
    )


class Gateway:
    def __init__(self, config: GatewayConfig, redis: aioredis.Redis | None = None):
        self.config = config
        self.keys = Keys(config.key_prefix)
        self.redis = redis or make_redis(config)
        self.metrics = GatewayMetrics()
        self.reply_stream = self.keys.replies(config.gateway_id)
        self.router = ReplyRouter(self.redis, self.reply_stream, config.reply_block_ms)
        self.router.on_duplicate = self.metrics.duplicate_replies.inc
        self.router.on_gap = lambda request_id: self.cancel_later(request_id, "replies_lost")
        self._backlogs = ModelBacklogs(
            self.redis,
            self.keys,
            max_queue_len=config.max_queue_len,
            max_queued_tokens=config.max_queued_tokens,
            retry_after_s=config.retry_after_s,
            cache_s=config.backlog_cache_s,
            placements=self.metrics.placements if config.prefix_placement else None,
        )
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="jitney-tokenizer")
        self.registry = ModelRegistry(
            self.redis,
            self.keys,
            self.tokenizer_thread,
            require_workers=not config.queue_without_workers,
            reasoning=config.reasoning_format,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self.draining = False  # stopping: no new requests, open ones finish
        self.active_requests = 0  # generation requests being handled (the drain waits for them)

    async def start(self) -> None:
        try:  # Redis may be down at start: the gateway still comes up and answers 503
            await self.redis.delete(self.reply_stream)
            await self.beat()
        except RedisError as e:
            log.warning("redis unavailable at start (%s); serving 503 until it is back", e)
        self.router.start()
        self.registry.start()
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="jitney-heartbeat")
        log.info(
            "gateway started id=%s prefix=%s max_queue_len=%d max_queued_tokens=%d",
            self.config.gateway_id,
            self.config.key_prefix,
            self.config.max_queue_len,
            self.config.max_queued_tokens,
        )

    async def stop(self) -> None:
        await cancel_and_wait(self._heartbeat)
        await self.router.stop()
        await self.registry.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.redis_timeout_s)
        try:  # leave promptly: workers abort what this gateway still had in flight
            async with asyncio.timeout(self.config.redis_timeout_s):
                await self.redis.zrem(self.keys.gateways, self.config.gateway_id)
                await self.redis.delete(self.reply_stream)
        except (RedisError, OSError, TimeoutError):
            pass
        await self.redis.aclose()
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def backlog(self, model: str) -> BacklogMonitor:
        """The backpressure monitor of one model's request stream."""
        return self._backlogs[model]

    async def backlogs(self, max_age_s: float | None = None) -> dict[str, Backlog]:
        """Each model's backlog: those with a card, and any enqueued to from here."""
        return await self._backlogs.read(max_age_s)

    async def beat(self) -> None:
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.gateways, {self.config.gateway_id: now})
        pipe.zremrangebyscore(self.keys.gateways, "-inf", now - STALE_GATEWAY_S)
        await pipe.execute()

    async def _heartbeat_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            try:
                await self.beat()
                failing = False
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("heartbeat failed: %s", type(e).__name__)
                failing = True

    def cancel_later(
        self, request_id: str, reason: str = "client_gone", index: int | None = None
    ) -> None:
        """Publish a cancel from a task of its own: the handler asking is usually being
        cancelled itself (client disconnect) and cannot await anything any more. `index`: one
        choice of the request only."""
        task = asyncio.create_task(self.publish_cancel(request_id, reason, index))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def publish_cancel(
        self, request_id: str, reason: str = "client_gone", index: int | None = None
    ) -> None:
        # The flag lets a worker drop a still-queued entry before prefill; the stream tells
        # workers already running it to stop within one step. One choice's cancel sets no flag:
        # the flag drops the whole request.
        try:
            pipe = self.redis.pipeline(transaction=False)
            if index is None:
                pipe.set(self.keys.cancelled(request_id), reason, ex=CANCEL_FLAG_TTL_S)
            pipe.xadd(
                self.keys.cancels,
                CancelMessage(request_id, reason, index).encode(),
                maxlen=CANCEL_STREAM_MAXLEN,
                approximate=True,
            )
            await pipe.execute()
            log.info("cancel published request_id=%s reason=%s index=%s", request_id, reason, index)
        except (RedisError, OSError) as e:
            log.warning("cancel not published request_id=%s: %s", request_id, type(e).__name__)
