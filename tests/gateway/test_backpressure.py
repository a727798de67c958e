"""Backpressure: over the queue bounds, 429 with Retry-After, fast, and nothing enqueued."""

from __future__ import annotations

import asyncio
import time

import redis

from gateway.config import GatewayConfig
from protocol import WORKER_GROUP, ReplyMessage
from tests.gateway.helpers import (
    MODEL,
    QUEUED_TOKENS,
    REQUESTS,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    tokens,
)

BODY = {"prompt": "hello", "stream": True}


def fill_queue(r: redis.Redis, n: int) -> None:
    """Entries nobody reads: the group exists (the gateway created it), so they count as lag."""
    r.xgroup_create(REQUESTS, WORKER_GROUP, id="0", mkstream=True)
    for i in range(n):
        r.xadd(REQUESTS, {"v": "1", "m": f'{{"junk": {i}}}'})


async def test_full_queue_gets_429_with_retry_after(
    served: redis.Redis, make_client: MakeClient
) -> None:
    """Lag at --max-queue-len: 429 queue_full + Retry-After, fast, XLEN unchanged."""
    fill_queue(served, 5)
    client = await make_client(max_queue_len=5)
    start = time.monotonic()
    response = await client.post("/v1/completions", json=BODY)
    elapsed = time.monotonic() - start
    assert response.status == 429 and response.headers["Retry-After"] == "1"
    out = await response.json()
    assert_openai_error(out)
    assert out["error"]["code"] == "queue_full" and out["error"]["type"] == "rate_limit_exceeded"
    assert served.xlen(REQUESTS) == 5
    # A refusal is one cached lag reading: milliseconds. One Redis timeout is the margin for a
    # loaded 2-core machine; a refusal slower than that waited for something it should not.
    assert elapsed < GatewayConfig().redis_timeout_s

    # A worker reads one entry: the lag drops below the bound and a request gets in.
    served.xreadgroup(WORKER_GROUP, "w", {REQUESTS: ">"}, count=1)
    await asyncio.sleep(0.15)  # past the lag reading's cache window
    response = await client.post("/v1/completions", json=BODY)
    assert response.status == 200
    assert served.xlen(REQUESTS) == 6
    response.close()


async def test_burst_cannot_overshoot_the_bound(
    served: redis.Redis, make_client: MakeClient
) -> None:
    """Concurrent requests within one cache window: exactly max_queue_len get in."""
    client = await make_client(max_queue_len=3, backlog_cache_s=10.0)
    responses = await asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(7)))
    statuses = sorted(r.status for r in responses)
    assert statuses == [200] * 3 + [429] * 4
    assert served.xlen(REQUESTS) == 3
    for r in responses:
        r.close()


async def test_queued_prompt_tokens_bound(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """Prompt tokens queued and not read by a worker are bounded (across gateways: the count
    lives in Redis); a request a worker has read frees its share."""
    client = await make_client(max_queued_tokens=10, backlog_cache_s=0.0)
    first = await client.post("/v1/completions", json={**BODY, "prompt": list(range(3, 11))})
    assert first.status == 200  # 8 tokens queued: a lone request is always admitted
    second = await client.post("/v1/completions", json={**BODY, "prompt": [3, 4, 5]})
    assert second.status == 429
    out = await second.json()
    assert out["error"]["code"] == "queue_full" and "8 + 3 > limit 10" in out["error"]["message"]
    assert served.xlen(REQUESTS) == 1

    request = await fake_worker.take()  # a worker reads the first: its tokens leave the queue
    await fake_worker.reply(request, ReplyMessage(request.request_id, 0, tokens("a")))
    await first.content.readuntil(b"\n\n")
    third = await client.post("/v1/completions", json={**BODY, "prompt": [3, 4, 5]})
    assert third.status == 200
    for r in (first, third):
        r.close()


async def test_metrics_report_queue_lag_and_pending(
    served: redis.Redis, make_client: MakeClient
) -> None:
    """/metrics: request counters by route and status, in-flight, lag and pending."""
    fill_queue(served, 4)
    served.xreadgroup(WORKER_GROUP, "w", {REQUESTS: ">"}, count=1)  # 1 pending, 3 lag
    client = await make_client()
    assert (await client.get("/health")).status == 200
    response = await client.get("/metrics")
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
    text = await response.text()
    assert 'jitney_http_requests_total{route="/health",status="200"} 1.0' in text
    assert "jitney_http_in_flight 1.0" in text  # the /metrics request itself
    labels = f'{{model="{MODEL}"}}'
    assert f"jitney_queue_lag{labels} 3.0" in text and f"jitney_queue_pending{labels} 1.0" in text


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


async def test_ttft_is_observed(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """The gateway's time to first token histogram counts answered requests."""
    client = await make_client()
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
    request = await fake_worker.take()
    await fake_worker.answer(request, ["a"])
    assert (await call).status == 200
    text = await (await client.get("/metrics")).text()
    count = _lines(text, 'jitney_gateway_time_to_first_token_seconds_count{model="tiny"}')
    assert count and count[0].endswith(" 1.0")


async def test_queued_token_count_a_crashed_worker_left_heals_when_the_queue_drains(
    served: redis.Redis, make_client: MakeClient
) -> None:
    """A worker killed between reading entries and lowering the shared count leaves it too
    high; the first reading that finds nothing queued resets it, so no 429 for ever after."""
    client = await make_client(max_queued_tokens=10, backlog_cache_s=0.0)
    first = await client.post("/v1/completions", json={**BODY, "prompt": [3, 4, 5]})
    assert first.status == 200
    served.xreadgroup(WORKER_GROUP, "killed-worker", {REQUESTS: ">"}, count=1)  # no DECRBY
    assert int(served.get(QUEUED_TOKENS)) == 3
    second = await client.post("/v1/completions", json={**BODY, "prompt": list(range(3, 11))})
    assert second.status == 200  # 3 + 8 > 10 without the reset
    assert int(served.get(QUEUED_TOKENS)) == 8
    for r in (first, second):
        r.close()
