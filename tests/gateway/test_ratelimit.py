"""Rate limits: token buckets in Redis shared by every gateway, 429 + Retry-After, refills,
tokens per minute, per client IP without keys, 503 (not 500) while Redis is down."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from gateway.config import RateLimits
from gateway.http.auth import Client
from gateway.http.ratelimit import RateLimiter
from gateway.openai.errors import ApiError
from gateway.serving.gateway_metrics import GatewayMetrics
from tests.gateway.helpers import (
    KEYS,
    REQUESTS,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    enqueued_total,
    http,
)
from tests.gateway.helpers import start_gateway as start
from tests.services import RedisServer

ALICE = "KEY-alice-77aa66bb"
BOB = "KEY-bob-55cc44dd"


def get_models(base: str, key: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, headers, body = http(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
    return status, headers, json.loads(body)


def test_request_limit_is_shared_by_two_gateways_and_refills(redis_server: RedisServer) -> None:
    """Burst 3 at 0.2 requests/s for alice, across two gateway processes on one Redis: the 4th
    request, on either gateway, is a 429 with Retry-After; bob's bucket is his own; after
    Retry-After seconds alice gets in again."""
    flags = (
        "--api-keys",
        f"alice:{ALICE},bob:{BOB}",
        "--rate-limit-rps",
        "0.2",
        "--rate-limit-burst",
        "3",
    )
    a = start(redis_server, *flags, name="gateway-a")
    b = start(redis_server, *flags, name="gateway-b")
    try:
        assert [get_models(gw.base, ALICE)[0] for gw in (a, b, a)] == [200, 200, 200]
        status, headers, out = get_models(b.base, ALICE)
        assert status == 429, out
        assert_openai_error(out)
        assert out["error"]["code"] == "rate_limit_exceeded"
        retry_after = int(headers["Retry-After"])
        assert 1 <= retry_after <= 5
        assert get_models(a.base, ALICE)[0] == 429  # the bucket is in Redis, not per process
        assert get_models(b.base, BOB)[0] == 200
        assert redis_server.client().exists(KEYS.ratelimit("alice"))

        time.sleep(retry_after)
        assert get_models(a.base, ALICE)[0] == 200  # refilled by one request
        assert get_models(b.base, ALICE)[0] == 429
        metrics = http(f"{b.base}/metrics", headers={"Authorization": f"Bearer {BOB}"})[2]
        assert 'jitney_api_key_requests_total{key_id="alice",status="429"} 2.0' in metrics.decode()
    finally:
        a.proc.stop()
        b.proc.stop()
    for gw in (a, b):
        assert ALICE not in gw.proc.output()


@pytest.fixture
async def limiter_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield r
    await r.aclose()


async def test_tokens_per_minute_bucket(limiter_redis: aioredis.Redis) -> None:
    """tpm=600 (10 tokens/s refill): 500 then 100 fit, 50 more waits ~5 s (Retry-After),
    a request over the whole bucket is a 400; two limiters (two replicas) share the bucket."""
    one = RateLimiter(limiter_redis, KEYS, GatewayMetrics())
    two = RateLimiter(limiter_redis, KEYS, GatewayMetrics())
    alice = Client("alice", "alice", RateLimits(tpm=600))
    await one.charge(alice, tokens=500)
    await two.charge(alice, tokens=100)
    with pytest.raises(ApiError) as e:
        await one.charge(alice, tokens=50)
    assert e.value.status == 429 and 4 <= int(e.value.headers["Retry-After"]) <= 6
    assert "600 tokens per minute" in e.value.message
    with pytest.raises(ApiError) as e:
        await two.charge(alice, tokens=601)
    assert e.value.status == 400 and e.value.code == "tokens_over_rate_limit"
    # A refused request charged nothing: bob's bucket is separate and full.
    await two.charge(Client("bob", "bob", RateLimits(tpm=600)), tokens=600)


async def test_buckets_refill_at_their_rate(limiter_redis: aioredis.Redis) -> None:
    """tpm=60000 is 1000 tokens/s: an emptied bucket holds 300 again after ~0.3 s; requests
    and tokens are separate buckets in one hash; a flushed script cache is reloaded."""
    limiter = RateLimiter(limiter_redis, KEYS, GatewayMetrics())
    client = Client("k", "k", RateLimits(rps=5, burst=1, tpm=60_000))
    await limiter.charge(client, requests=1, tokens=60_000)
    with pytest.raises(ApiError) as e:
        await limiter.charge(client, tokens=300)
    assert e.value.headers["Retry-After"] == "1"
    with pytest.raises(ApiError):
        await limiter.charge(client, requests=1)
    await asyncio.sleep(0.4)
    await limiter_redis.script_flush()  # as after a Redis restart: NOSCRIPT, then reloaded
    await limiter.charge(client, tokens=300)
    await limiter.charge(client, requests=1)  # 0.4 s at 5/s refilled the one-request burst
    ttl = await limiter_redis.pttl(KEYS.ratelimit("k"))
    assert 0 < ttl <= 61_000  # buckets of idle clients expire (full again by then anyway)


async def test_without_keys_the_limit_is_per_client_ip(
    served: redis.Redis, make_client: MakeClient
) -> None:
    """No API keys: the bucket is the client's IP; probes are never limited."""
    client = await make_client(rate_limits=RateLimits(rps=0.1, burst=2))
    assert [(await client.get("/v1/models")).status for _ in range(3)] == [200, 200, 429]
    assert served.exists(KEYS.ratelimit("ip:127.0.0.1"))
    assert all([(await client.get("/health")).status == 200 for _ in range(3)])
    response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status == 429 and "Retry-After" in response.headers
    assert served.xlen(REQUESTS) == 0


async def test_redis_down_is_503_not_500(
    redis_server: RedisServer, served: redis.Redis, make_client: MakeClient
) -> None:
    """The limiter cannot reach Redis: 503 with Retry-After, like every generation route."""
    client = await make_client(
        rate_limits=RateLimits(rps=100), redis_timeout_s=0.5, reply_block_ms=200
    )
    assert (await client.get("/v1/models")).status == 200
    redis_server.stop()
    for route in ("/v1/models", "/v1/completions"):
        response = await client.request("POST" if "compl" in route else "GET", route, json={})
        assert response.status == 503, route
        assert_openai_error(await response.json())


async def test_tokens_per_minute_over_http(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """prompt + max_tokens is charged at admission: 15-token requests against tpm=40 give
    200, 200, then 429 with nothing enqueued; a request over the bucket is a 400."""
    client = await make_client(rate_limits=RateLimits(tpm=40))
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 10}
    for _ in range(2):
        call = asyncio.create_task(client.post("/v1/completions", json=body))
        await fake_worker.answer(await fake_worker.take(), ["x"])
        assert (await call).status == 200
    response = await client.post("/v1/completions", json=body)
    assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
    response = await client.post("/v1/completions", json={**body, "max_tokens": 50})
    assert response.status == 400  # 55 tokens fit the context window (64), never the bucket
    assert (await response.json())["error"]["code"] == "tokens_over_rate_limit"
    assert enqueued_total(served) == 2
