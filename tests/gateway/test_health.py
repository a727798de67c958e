"""Health, readiness, the model list, and life without (and after) Redis."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import redis
from aiohttp.test_utils import TestClient

from protocol import HEARTBEAT_TTL_S, ModelCard
from tests.gateway.helpers import (
    KEYS,
    MAX_MODEL_LEN,
    REQUESTS,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    eventually,
    heartbeat,
    publish_card,
)
from tests.services import RedisServer

Client = TestClient[Any, Any]


async def test_ready_needs_a_fresh_worker_heartbeat(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient
) -> None:
    """/ready: 503 with no heartbeat or a stale one, 200 with a fresh one; /health always 200."""
    publish_card(sync_redis, card)
    client = await make_client()
    assert (await client.get("/health")).status == 200
    response = await client.get("/ready")
    assert response.status == 503 and "heartbeat" in (await response.json())["reason"]
    heartbeat(sync_redis, at=time.time() - HEARTBEAT_TTL_S - 1)
    assert (await client.get("/ready")).status == 503
    heartbeat(sync_redis)
    response = await client.get("/ready")
    assert response.status == 200 and (await response.json())["workers"] == 1


async def test_ready_waits_for_the_model_card_requests_need(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient
) -> None:
    """A heartbeat before the worker's card is published: /ready stays 503 (a request would get
    no_workers); once the card is there, /ready is 200 and so is a request's model lookup."""
    client = await make_client()
    heartbeat(sync_redis)
    response = await client.get("/ready")
    assert response.status == 503 and "model card" in (await response.json())["reason"]
    publish_card(sync_redis, card)

    async def ready() -> bool:  # a miss re-reads the cards at most every miss_rescan_s
        return (await client.get("/ready")).status == 200

    await eventually(ready)
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [card.name]


async def test_models_lists_cards_of_live_workers(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient
) -> None:
    """/v1/models lists published cards only while a worker heartbeats."""
    publish_card(sync_redis, card)
    client = await make_client()
    assert (await (await client.get("/v1/models")).json())["data"] == []
    heartbeat(sync_redis)

    async def listed() -> dict | None:  # the registry re-reads at most once a second
        out = await (await client.get("/v1/models")).json()
        return out if out["data"] else None

    out = await eventually(listed)
    assert out["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in out["data"]] == [
        ("tiny", "model", MAX_MODEL_LEN)
    ]


async def test_no_live_worker_and_no_model_named(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient
) -> None:
    """Without a live worker a request naming no model is a 503 no_workers, not a hang."""
    publish_card(sync_redis, card)
    client = await make_client()
    response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status == 503 and (await response.json())["error"]["code"] == "no_workers"
    assert sync_redis.xlen(REQUESTS) == 0


async def test_gateway_heartbeats_itself(served: redis.Redis, make_client: MakeClient) -> None:
    """The gateway's id is in keys.gateways with a fresh score, and leaves it on shutdown."""
    client = await make_client()
    score = served.zscore(KEYS.gateways, "gw-test")
    assert score is not None and time.time() - score < HEARTBEAT_TTL_S
    await client.close()
    assert served.zscore(KEYS.gateways, "gw-test") is None


async def test_redis_down_gives_503_then_recovers(
    redis_server: RedisServer,
    served: redis.Redis,
    card: ModelCard,
    make_client: MakeClient,
    fake_worker: FakeWorker,
) -> None:
    """Redis stopped: 503s with an OpenAI body, fast; restarted: requests flow again."""
    client = await make_client()
    waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi"}))
    await eventually(lambda: served.xlen(REQUESTS) == 1)  # queued, never started
    redis_server.stop()
    start = time.monotonic()
    response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status == 503
    assert_openai_error(await response.json())
    response = await client.get("/ready")
    assert response.status == 503 and "redis" in (await response.json())["reason"]
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200
    assert time.monotonic() - start < 10

    redis_server.start()  # same port, empty: the gateway reconnects by itself
    response = await waiting  # its entry is gone with Redis' data: a clear 503, not a hang
    assert response.status == 503 and (await response.json())["error"]["code"] == "aborted"
    publish_card(served, card)
    heartbeat(served)
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi"}))
    request = await fake_worker.take()
    await fake_worker.answer(request, ["ok"])
    response = await call
    assert response.status == 200  # the reply reader survived the outage
    assert (await response.json())["choices"][0]["text"] == "ok"


async def test_each_model_is_served_by_its_own_workers(
    served: redis.Redis,
    card: ModelCard,
    make_client: MakeClient,
    fake_worker: FakeWorker,
    redis_server: RedisServer,
) -> None:
    """Two models: `model` is required (400) and routes the request to the stream its own
    workers read; a model whose card exists but whose workers are all gone is not served."""
    publish_card(served, replace(card, name="tiny2", max_model_len=32))
    client = await make_client()
    out = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in out["data"]] == ["tiny"]  # no live worker serves tiny2
    response = await client.post("/v1/completions", json={"prompt": "hi", "model": "tiny2"})
    body = await response.json()
    assert response.status == 404 and body["error"]["code"] == "model_not_found"
    assert_openai_error(body, param="model")

    heartbeat(served, "worker-2", model="tiny2")
    await asyncio.sleep(1.1)  # past the re-read of liveness (live_s)
    out = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in out["data"]] == ["tiny", "tiny2"]
    response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status == 400 and (await response.json())["error"]["param"] == "model"
    second = FakeWorker.connect(redis_server.url, "worker-2", model="tiny2")
    try:
        call = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": "hi", "model": "tiny2"})
        )
        request = await second.take()
        assert request.model == "tiny2"
        assert fake_worker.read(1, 100) == []  # tiny's workers never see it
        await second.answer(request, ["x"])
        assert (await (await call).json())["model"] == "tiny2"
    finally:
        second.close()


async def test_a_worker_that_starts_later_is_found_at_once(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """Gateway first, worker later: its first request is served without waiting for a rescan."""
    client = await make_client()
    assert (await client.get("/v1/models")).status == 200  # caches "no worker, no card"
    await asyncio.sleep(0.6)  # past the miss re-read interval, well within the rescan period
    publish_card(sync_redis, card)
    heartbeat(sync_redis)
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi"}))
    request = await fake_worker.take()
    await fake_worker.answer(request, ["x"])
    assert (await call).status == 200
