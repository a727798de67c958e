"""Gateway test helpers: the model card, heartbeats, and a hand-played worker (FakeWorker).

The tests play the worker's part by hand: read the request entry with XREADGROUP and write
ReplyMessages to its reply stream, so the gateway is tested without torch or a model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis
import redis.asyncio as aioredis

from jitney.protocol import WORKER_GROUP, Keys, ModelCard, ReplyMessage, RequestMessage

MODEL = "tiny"
MAX_MODEL_LEN = 64
KEYS = Keys("jitney")
MakeClient = Callable[..., Any]  # the make_client fixture: overrides of GatewayConfig


def publish_card(r: redis.Redis, card: ModelCard) -> None:
    r.hset(KEYS.model(card.name), mapping=card.encode())


def heartbeat(r: redis.Redis, worker_id: str = "fake-worker", at: float | None = None) -> None:
    r.zadd(KEYS.workers, {worker_id: time.time() if at is None else at})


class FakeWorker:
    """Plays the worker: takes the next request off the queue and answers with given replies."""

    def __init__(self, r: aioredis.Redis):
        self.redis = r

    async def take(self, timeout_ms: int = 5000) -> RequestMessage:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            try:
                result = await self.redis.xreadgroup(
                    WORKER_GROUP, "fake", {KEYS.requests: ">"}, count=1, block=timeout_ms
                )
                break
            except redis.ResponseError:  # NOGROUP: the gateway creates it when it enqueues
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)
        assert result, "no request was enqueued"
        (_stream, [(_id, fields)]) = result[0]
        return RequestMessage.decode(fields)

    async def reply(self, request: RequestMessage, *replies: ReplyMessage) -> None:
        for reply in replies:
            await self.redis.xadd(request.reply_to, reply.encode())

    async def answer(
        self, request: RequestMessage, pieces: list[str], finish: str = "stop"
    ) -> list[ReplyMessage]:
        """One reply per piece (token ids 10, 11, ...), the last one final."""
        n = len(request.prompt_token_ids)
        replies = [
            ReplyMessage(request.request_id, seq, [10 + seq], text)
            for seq, text in enumerate(pieces)
        ]
        last = replies[-1]
        replies[-1] = replace(
            last, finish_reason=finish, prompt_tokens=n, completion_tokens=len(pieces)
        )
        await self.reply(request, *replies)
        return replies


def assert_openai_error(body: dict[str, Any], param: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


async def eventually(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
