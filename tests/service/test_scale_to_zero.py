"""Scale to zero: with --queue-without-workers a gateway accepts requests while no worker is live;
they wait in the queue (what an autoscaler watching its lag sees) until a worker starts."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp

from protocol import Keys
from tests.service.helpers import MODEL
from tests.services import RedisServer, start_gateway, start_worker, wait_for, wait_ready

KEYS = Keys()
REQUESTS = KEYS.requests(MODEL)


async def test_requests_wait_in_the_queue_for_the_first_worker():
    server = RedisServer().start()
    r = server.client()
    gateway = None
    try:
        # A worker once published the model's card, then the deployment scaled to zero.
        first = start_worker(server, "first")
        wait_ready(r, first)
        assert first.proc.stop() == 0
        gateway = start_gateway(server, "--queue-without-workers")
        gateway.wait_ready()  # ready with Redis alone
        with urllib.request.urlopen(f"{gateway.base}/ready", timeout=5) as resp:
            assert json.load(resp)["workers"] == 0
        body = {
            "model": "tiny-random",
            "prompt": "wake up",
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,  # the length is counted below
        }
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(session.post(f"{gateway.base}/v1/completions", json=body))
            await asyncio.to_thread(
                wait_for, lambda: r.xlen(REQUESTS) == 1, 30, "the request queued"
            )
            assert not call.done()
            second = start_worker(server, "second")  # what KEDA does on lagCount > 0
            try:
                resp = await asyncio.wait_for(call, 90)
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 4
            finally:
                second.proc.stop()
    finally:
        if gateway is not None:
            gateway.proc.stop()
        server.close()
