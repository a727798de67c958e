"""`jitney worker --model noop`: the real worker loop and protocol without a model, for load
tests; it serves through a real gateway and names itself in /v1/models."""

from __future__ import annotations

import json
import urllib.request

from tests.services import RedisServer, start_gateway, start_worker, wait_ready


def test_a_noop_worker_serves_through_the_gateway_and_says_what_it_is():
    server = RedisServer().start()
    worker = start_worker(server, "noop-1", "--noop-step-ms", "2", model="noop")
    gateway = start_gateway(server)
    try:
        wait_ready(server.client(), worker)
        gateway.wait_ready()
        with urllib.request.urlopen(f"{gateway.base}/v1/models", timeout=10) as resp:
            models = json.load(resp)["data"]
        assert [m["id"] for m in models] == ["noop"]
        assert "load testing only" in models[0]["owned_by"]
        body = {"model": "noop", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0}
        request = urllib.request.Request(
            f"{gateway.base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            out = json.load(resp)
        assert out["usage"]["completion_tokens"] == 40
        assert out["choices"][0]["finish_reason"] == "length"
        assert "NOOP" in worker.proc.output()  # it says so at start-up
    finally:
        gateway.proc.stop()
        worker.proc.stop()
        server.close()
