"""The FakeWorker the gateway tests use, held to a real `jitney worker`: the same scenarios run
through the in-process gateway against each, and what the client gets and what Redis holds
afterwards must agree. So a change in the worker's half of the protocol that the fake does not
follow fails here, not silently in the gateway tests.

(The fake's Redis calls are the worker's own, WorkerRedis; this checks what it answers.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from protocol import WORKER_GROUP, ModelCard, RequestMessage
from tests.gateway.helpers import (
    KEYS,
    FakeWorker,
    MakeClient,
    heartbeat,
    publish_card,
    replies_for,
)
from tests.services import RedisServer, Worker, start_worker, wait_for, wait_ready

REAL_MODEL = "tiny-random"
# Both the real worker and the fake serve REAL_MODEL (the fake takes the real card's name).
REQUESTS = KEYS.requests(REAL_MODEL)
QUEUED_TOKENS = KEYS.queued_tokens(REAL_MODEL)
Play = Callable[[FakeWorker, RequestMessage], Awaitable[Any]]


@dataclass
class RealWorker:
    server: RedisServer
    worker: Worker
    card: ModelCard


@pytest.fixture(scope="module")
def real() -> Iterator[RealWorker]:
    server = RedisServer().start()
    worker = start_worker(server, "contract-w1")
    try:
        r = server.client()
        wait_ready(r, worker)
        yield RealWorker(server, worker, ModelCard.decode(r.hgetall(KEYS.model(REAL_MODEL))))
    finally:
        worker.proc.stop()
        server.close()


@dataclass(frozen=True)
class Seen:
    """What a scenario showed: the client's response, and what Redis holds once it is over."""

    status: int
    finish_reasons: tuple[str, ...]  # of the choices (several chunks when streamed)
    usage: dict[str, int] | None
    error: tuple[str, str | None] | None  # type and code
    done: bool  # a stream ended with [DONE]
    leftovers: dict[str, int]


def leftovers(r: redis.Redis) -> dict[str, int]:
    """What a finished request must not leave behind: its entry (unacked or undeleted), queued
    prompt tokens, unread replies."""
    pending = r.xpending(REQUESTS, WORKER_GROUP)["pending"] if r.exists(REQUESTS) else 0
    return {
        "entries": r.xlen(REQUESTS),
        "pending": pending,
        "queued_tokens": int(r.get(QUEUED_TOKENS) or 0),
        "unread_replies": sum(r.xlen(k) for k in r.scan_iter(KEYS.replies("*"))),
    }


async def settled(r: redis.Redis) -> dict[str, int]:
    """Leftovers once the gateway has trimmed what it read (it does so just after replying)."""

    def clean() -> bool:
        return not any(leftovers(r).values())

    with contextlib.suppress(TimeoutError):  # what is left shows in the comparison
        await asyncio.to_thread(wait_for, clean, 5, "the request's keys cleaned up")
    return leftovers(r)


async def observe(response: Any, r: redis.Redis) -> Seen:
    if response.content_type == "text/event-stream":
        lines = [ln for ln in (await response.text()).split("\n") if ln.startswith("data: ")]
        done = lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
    else:
        done, chunks = False, [await response.json()]
    errors = [c["error"] for c in chunks if "error" in c]
    choices = [choice for c in chunks for choice in c.get("choices", [])]
    return Seen(
        status=response.status,
        finish_reasons=tuple(ch["finish_reason"] for ch in choices if ch["finish_reason"]),
        usage=next((c["usage"] for c in chunks if c.get("usage")), None),
        error=(errors[0]["type"], errors[0].get("code")) if errors else None,
        done=done,
        leftovers=await settled(r),
    )


PROMPT = [5, 6, 7, 8]
LENGTH = {"model": REAL_MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


async def answer_three(fake: FakeWorker, request: RequestMessage) -> None:
    await fake.answer(request, ["a", "b", "c"], finish="length")


async def answer_two_choices(fake: FakeWorker, request: RequestMessage) -> None:
    """n=2: each choice its own replies (index), seq counting across them; the last final acks."""
    first = replies_for(request, ["a", "b", "c"], finish="length", index=0)
    second = replies_for(request, ["d", "e", "f"], finish="length", index=1, first_seq=3)
    await fake.reply(request, *first, *second)


async def expire(fake: FakeWorker, request: RequestMessage) -> None:
    await fake.reject(request, "expired", "deadline passed before start")


# name -> request body, gateway settings, the fake's part. `expired`: the request's deadline
# passes while the (real) worker is paused, so it finds the request expired when it reads it.
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any], Play]] = {
    "length": (LENGTH, {}, answer_three),
    "length-streamed": ({**LENGTH, **STREAM}, {}, answer_three),
    "two-choices": ({**LENGTH, "n": 2}, {}, answer_two_choices),
    "expired": (LENGTH, {"request_timeout": 0.05}, expire),
    "expired-streamed": ({**LENGTH, **STREAM}, {"request_timeout": 0.05}, expire),
}


async def with_fake(
    make_client: MakeClient, redis_server: RedisServer, card: ModelCard, scenario: str
) -> Seen:
    body, config, play = SCENARIOS[scenario]
    r = redis_server.client()
    publish_card(r, card)
    heartbeat(r, model=card.name)
    client = await make_client(**config)
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    fake = FakeWorker.connect(redis_server.url, model=card.name)
    try:
        await play(fake, await fake.take())
        return await observe(await call, r)
    finally:
        fake.close()


async def with_real(make_client: MakeClient, real: RealWorker, scenario: str) -> Seen:
    body, config, _ = SCENARIOS[scenario]
    r = real.server.client()
    client = await make_client(redis_url=real.server.url, **config)
    pause = "request_timeout" in config
    if pause:
        real.worker.proc.proc.send_signal(signal.SIGSTOP)
    try:
        call = asyncio.create_task(client.post("/v1/completions", json=body))
        if pause:  # enqueued, and its deadline passed, before the worker can look at it
            await asyncio.to_thread(wait_for, lambda: r.xlen(REQUESTS) > 0, 10, "enqueued")
            await asyncio.sleep(config["request_timeout"] * 2)
    finally:
        if pause:
            real.worker.proc.proc.send_signal(signal.SIGCONT)
    return await observe(await call, r)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_fake_worker_answers_as_the_real_worker_does(
    scenario: str, real: RealWorker, make_client: MakeClient, redis_server: RedisServer
) -> None:
    want = await with_real(make_client, real, scenario)
    got = await with_fake(make_client, redis_server, real.card, scenario)
    assert got == want
    assert want.status in (200, 504) and not any(want.leftovers.values())


def test_fake_joins_as_the_real_worker_does(real: RealWorker, redis_server: RedisServer) -> None:
    """publish_card and heartbeat write the keys a joined worker writes, of the same types."""
    r = redis_server.client()
    publish_card(r, real.card)
    heartbeat(r, model=real.card.name)
    real_r = real.server.client()
    written = {key: r.type(key) for key in r.scan_iter()}
    assert written.items() <= {key: real_r.type(key) for key in real_r.scan_iter()}.items()
    assert r.hgetall(KEYS.model(REAL_MODEL)) == real_r.hgetall(KEYS.model(REAL_MODEL))
