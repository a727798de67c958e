"""`jitney up`: one command starts Redis, a gateway and a worker; SIGTERM stops all of them."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request

import redis

from tests.services import JitneyProcess, free_port, wait_for


def test_up_serves_a_chat_request_and_stops_everything_on_sigterm():
    """A chat request succeeds through the stack `jitney up` starts; SIGTERM exits 0 and leaves
    no gateway, worker or private Redis behind."""
    port, metrics_port = free_port(), free_port()
    up = JitneyProcess(
        [
            "up",
            "--model",
            "tiny-random",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--kv-cache-memory",
            "16MiB",
        ],
        {"REDIS_URL": ""},
        name="up",
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert up.alive(), up.output()
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as resp:
                return resp.status == 200

        wait_for(ready, 120, "jitney up to be ready")
        wait_for(lambda: "Jitney is up" in up.output(), 10, "the banner with the URL")
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        req = urllib.request.Request(
            f"{base}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            reply = json.load(resp)
        assert reply["usage"]["completion_tokens"] == 4
        redis_url = next(
            line.split(" at ", 1)[1].strip()
            for line in up.output().splitlines()
            if "private redis-server at" in line
        )
        assert up.stop(signal.SIGTERM, timeout=90) == 0
    finally:
        up.stop(signal.SIGKILL)
    output = up.output()
    assert "Jitney is up" in output and "curl" in output
    for url in (f"{base}/health", f"http://127.0.0.1:{metrics_port}/metrics"):
        try:
            urllib.request.urlopen(url, timeout=2)
            raise AssertionError(f"{url} still answers after jitney up stopped")
        except OSError:
            pass
    try:
        redis.Redis.from_url(redis_url, socket_timeout=1).ping()
        raise AssertionError("the private redis-server outlived jitney up")
    except redis.ConnectionError:
        pass


def test_up_restarts_a_worker_that_dies():
    """A worker killed under `jitney up` is restarted (as Kubernetes would) and serving goes on."""
    port = free_port()
    up = JitneyProcess(
        [
            "up",
            "--model",
            "tiny-random",
            "--port",
            str(port),
            "--metrics-port",
            str(free_port()),
            "--kv-cache-memory",
            "16MiB",
        ],
        {"REDIS_URL": ""},
        name="up",
    )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert up.alive(), up.output()
        with urllib.request.urlopen(f"{base}/ready", timeout=2) as resp:
            return resp.status == 200

    def complete() -> dict:
        body = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
        req = urllib.request.Request(
            f"{base}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)

    try:
        wait_for(ready, 120, "jitney up to be ready")
        pid = int(re.search(r"started worker-0 pid=(\d+)", up.output()).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: "restarted worker-0" in up.output(), 30, "the worker restarted")
        wait_for(ready, 60, "ready again")
        assert complete()["usage"]["completion_tokens"] == 4
        assert up.alive()
        assert up.stop(signal.SIGTERM, timeout=90) == 0
    finally:
        up.stop(signal.SIGKILL)
