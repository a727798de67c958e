"""GET /ui and /ui/events in-process: the merged frame, what it leaves out, auth; the page in
headless Chromium."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
import redis
from aiohttp.test_utils import TestClient

from gateway.config import ApiKey
from protocol.snapshot import BatchSnapshot, Seat
from tests.gateway.helpers import KEYS, MODEL, REQUESTS, MakeClient, heartbeat
from tests.observability.cdp import Page, chromium

KEY = "sk-live-view-test"


def snapshot(worker: str, phases: list[str]) -> BatchSnapshot:
    seats = [Seat(f"{i:08x}", 0, p, i, 100, 10, 11, 0) for i, p in enumerate(phases)]
    return BatchSnapshot(worker, "tiny", time.time(), 4, 5, 64, 2, 1, 2, 3.25, "none", seats)


async def first_frame(client: TestClient[Any, Any], **headers: str) -> dict[str, Any]:
    response = await client.get("/ui/events", headers=headers)
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    line = await response.content.readline()
    response.close()
    assert line.startswith(b"data: ")
    return json.loads(line[len(b"data: ") :])


async def test_events_merge_the_live_workers_snapshots(
    sync_redis: redis.Redis, make_client: MakeClient
) -> None:
    """Live workers' snapshots, sorted by worker; a worker without a lease or with an unreadable
    snapshot is left out; the queue's lag comes along."""
    for worker, phases in [("w2", ["decode", "prefill", "waiting"]), ("w1", ["decode"])]:
        heartbeat(sync_redis, worker)
        sync_redis.set(KEYS.live_batch(worker), snapshot(worker, phases).encode())
    heartbeat(sync_redis, "dead", at=time.time() - 60)
    sync_redis.set(KEYS.live_batch("dead"), snapshot("dead", ["decode"]).encode())
    heartbeat(sync_redis, "garbled")
    sync_redis.set(KEYS.live_batch("garbled"), b"{not json")
    heartbeat(sync_redis, "starting")  # live, nothing published yet
    sync_redis.xadd(REQUESTS, {"m": "queued"})
    sync_redis.sadd(KEYS.models, MODEL)  # a served model: its stream's lag is read
    client = await make_client()
    frame = await first_frame(client)
    assert [w["worker"] for w in frame["workers"]] == ["w1", "w2"]
    assert frame["queue"]["lag"] >= 1 and frame["queue"]["models"][MODEL]["lag"] >= 1
    w2 = BatchSnapshot.from_dict(frame["workers"][1])
    assert [s.phase for s in w2.seats] == ["decode", "prefill", "waiting"]
    assert w2.to_dict() == snapshot("w2", ["decode", "prefill", "waiting"]).to_dict() | {
        "time": w2.time
    }


async def test_events_say_when_redis_is_down(make_client: MakeClient) -> None:
    client = await make_client(redis_url="redis://127.0.0.1:1/0")
    frame = await first_frame(client)
    assert frame["workers"] == [] and "redis unavailable" in frame["error"]


async def test_the_page_is_one_self_contained_file(make_client: MakeClient) -> None:
    client = await make_client()
    response = await client.get("/ui")
    assert response.status == 200 and response.content_type == "text/html"
    page = await response.text()
    assert "live batch view" in page and "<canvas" in page
    # Nothing fetched from elsewhere: no external scripts, styles, fonts or images.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and "url(" not in page


async def test_the_page_opens_without_a_key_but_its_data_needs_one(
    make_client: MakeClient,
) -> None:
    """A browser cannot send a header when it navigates: the page (static, no data) is public;
    what it shows comes from /ui/events, which needs the key like /v1/*."""
    client = await make_client(api_keys=(ApiKey("ops", KEY),))
    assert (await client.get("/ui")).status == 200
    assert (await client.get("/ui/events")).status == 401
    assert (await client.get("/ui", headers={"Authorization": f"Bearer {KEY}"})).status == 200
    frame = await first_frame(client, Authorization=f"Bearer {KEY}")
    assert frame["workers"] == []


async def test_the_page_shows_the_tokens_each_decoding_seat_got_from_its_last_step(
    sync_redis: redis.Redis, make_client: MakeClient
) -> None:
    """Speculative decoding: a seat whose last step kept drafts shows the count over its bar and
    in its title, and the worker's line the mean over its decoding seats (3 and 1: 2.00)."""
    snap = snapshot("w1", ["decode", "decode", "prefill"])
    for seat, tokens in zip(snap.seats, (3, 1, 0), strict=True):
        seat.step_tokens = tokens
    heartbeat(sync_redis, "w1")
    sync_redis.set(KEYS.live_batch("w1"), snap.encode())
    client = await make_client()
    seats_js = """JSON.stringify([...document.querySelectorAll('.seat:not(.free)')]
      .map(s => [s.dataset.step, s.textContent, s.title]))"""
    with chromium() as port:
        async with aiohttp.ClientSession() as session:
            page = await Page.open(session, port)
            await page.call("Page.navigate", url=str(client.make_url("/ui")))
            for _ in range(100):
                shown = await page.evaluate(
                    "(document.querySelector('.steptokens') || {}).textContent || ''"
                )
                if shown:
                    break
                await asyncio.sleep(0.1)
            seats = json.loads(await page.evaluate(seats_js))
    assert shown == "2.00 tokens/step"
    assert [s[:2] for s in seats] == [["3", "3"], ["1", ""], ["0", ""]]
    assert "last step gave 3 tokens" in seats[0][2] and "last step gave 1 token" in seats[1][2]
