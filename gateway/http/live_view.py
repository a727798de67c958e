"""The live batch view: `GET /ui` (one static page) and `GET /ui/events` (server-sent events).

Every SNAPSHOT_INTERVAL_S a viewer gets one frame: the live workers' snapshots (each worker
publishes its own, protocol/snapshot.py) merged with the request stream's queue lag from the
gateway's BacklogMonitor. Both routes sit behind the API's auth middleware. One `LiveFeed` per
gateway reads Redis for all viewers (two round trips per interval, however many watch);
`jitney top` uses the same feed straight on Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError

from gateway.app_state import GATEWAY
from gateway.serving.backlog import Backlog
from protocol import HEARTBEAT_TTL_S, Keys, ProtocolError
from protocol.snapshot import SNAPSHOT_INTERVAL_S, BatchSnapshot

log = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "static" / "live.html"


@dataclass(slots=True)
class LiveFeed:
    redis: aioredis.Redis
    keys: Keys
    # Every served model's backlog (Gateway.backlogs), read together.
    backlogs: Callable[..., Awaitable[dict[str, Backlog]]]
    max_age_s: float = SNAPSHOT_INTERVAL_S / 2
    _frame: dict[str, Any] | None = None
    _read_at: float = -float("inf")
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def frame(self) -> dict[str, Any]:
        """The merged view; viewers within `max_age_s` of each other share one reading."""
        async with self._lock:
            if self._frame is None or time.monotonic() - self._read_at >= self.max_age_s:
                self._frame = await self._read()
                self._read_at = time.monotonic()
            return self._frame

    async def _read(self) -> dict[str, Any]:
        now = time.time()
        try:
            live = await self.redis.zrangebyscore(self.keys.workers, now - HEARTBEAT_TTL_S, "+inf")
            names = sorted(w.decode() if isinstance(w, bytes) else w for w in live)
            raw = await self.redis.mget([self.keys.live_batch(w) for w in names]) if names else []
            backlogs = await self.backlogs(max_age_s=self.max_age_s)
        except (RedisError, OSError, TimeoutError) as e:
            return {"time": now, "error": f"redis unavailable ({type(e).__name__})", "workers": []}
        workers = []
        for name, value in zip(names, raw, strict=True):
            if value is None:
                continue  # live, but no snapshot yet (just started)
            try:
                workers.append(BatchSnapshot.decode(value).to_dict())
            except ProtocolError:
                log.debug("unreadable live snapshot worker=%s", name)
        return {
            "time": now,
            "queue": {
                "lag": sum(b.lag for b in backlogs.values()),
                "pending": sum(b.pending for b in backlogs.values()),
                "models": {m: {"lag": b.lag, "pending": b.pending} for m, b in backlogs.items()},
            },
            "workers": workers,
        }


LIVE_FEED: web.AppKey[LiveFeed] = web.AppKey("jitney_live_feed", LiveFeed)


async def page(request: web.Request) -> web.Response:
    return web.Response(
        body=PAGE.read_bytes(),
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


async def events(request: web.Request) -> web.StreamResponse:
    gw, feed = request.app[GATEWAY], request.app[LIVE_FEED]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx: pass each frame on at once
        }
    )
    await response.prepare(request)
    try:
        while not gw.draining:  # a stopping gateway ends the stream; the page reconnects
            frame = await feed.frame()
            await response.write(f"data: {json.dumps(frame, separators=(',', ':'))}\n\n".encode())
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
    except ConnectionError:
        pass  # the viewer left
    return response


def setup_live_view(app: web.Application) -> None:
    gw = app[GATEWAY]
    app[LIVE_FEED] = LiveFeed(gw.redis, gw.keys, gw.backlogs)
    app.router.add_get("/ui", page)
    app.router.add_get("/ui/events", events)
