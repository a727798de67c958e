"""`jitney up`: one command starts Redis, a gateway and a worker; SIGTERM stops all of them, and
so does the kernel when `up` is killed outright. `jitney top` beside it finds its private Redis."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis

from tests import processes
from tests.services import JitneyProcess, free_port, serving, wait_for

# Greedy with EOS ignored: a counted length cannot come out short on the tiny random model.
EXACT = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
# Idle parts exit a second or two after their SIGTERM; the rest is margin for a loaded 2-core
# machine, still well under the 90 s `up` itself grants a part to drain.
PARTS_EXIT_S = 30


def start_up(port: int, runtime_dir: Path, metrics_port: int | None = None) -> JitneyProcess:
    """`jitney up` with one tiny-random worker and a private redis-server; it leaves the file
    `jitney top` finds it by in `runtime_dir` (not the user's own)."""
    args = ["up", "--model", "tiny-random", "--port", str(port), "--kv-cache-memory", "16MiB"]
    args += ["--metrics-port", str(metrics_port or free_port())]
    return JitneyProcess(args, {"REDIS_URL": "", **runtime_env(runtime_dir)}, name="up")


def runtime_env(runtime_dir: Path) -> dict[str, str]:
    return {"XDG_RUNTIME_DIR": str(runtime_dir)}


def wait_until_ready(up: JitneyProcess, base: str, timeout: float = 120) -> None:
    def ready() -> bool:
        assert up.alive(), up.output()
        return serving(base)

    wait_for(ready, timeout, "jitney up to be ready")


def private_redis_url(up: JitneyProcess) -> str:
    return next(
        line.split(" at ", 1)[1].strip()
        for line in up.output().splitlines()
        if "private redis-server at" in line
    )


def post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{base}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def test_up_serves_a_chat_request_and_stops_everything_on_sigterm(tmp_path):
    """A chat request succeeds through the stack `jitney up` starts; SIGTERM exits 0 and leaves
    no gateway, worker or private Redis behind."""
    port, metrics_port = free_port(), free_port()
    up = start_up(port, tmp_path, metrics_port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(up, base)
        wait_for(lambda: "Jitney is up" in up.output(), 10, "the banner with the URL")
        chat = {"messages": [{"role": "user", "content": "hi"}], **EXACT}
        reply = post(base, "/v1/chat/completions", chat)
        assert reply["usage"]["completion_tokens"] == EXACT["max_tokens"]
        redis_url = private_redis_url(up)
        assert up.stop(signal.SIGTERM, timeout=90) == 0
    finally:
        up.stop(signal.SIGKILL)
    output = up.output()
    assert "Jitney is up" in output and "curl" in output
    # The start-up lines say how many threads the worker computes on, and why; the worker
    # itself logs the same count.
    said = re.search(r"worker threads: (\d+) each \(", output)
    assert said, output[:2000]
    count = said.group(1)
    assert any(
        line.startswith("[worker-0]") and f"threads: {count} (" in line
        for line in output.splitlines()
    )
    assert f"{count} thread(s) each" in output
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


def test_up_restarts_a_worker_that_dies(tmp_path):
    """A worker killed under `jitney up` is restarted (as Kubernetes would) and serving goes on."""
    port = free_port()
    up = start_up(port, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(up, base)
        pid = int(re.search(r"started worker-0 pid=(\d+)", up.output()).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: "restarted worker-0" in up.output(), 30, "the worker restarted")
        wait_until_ready(up, base, timeout=60)
        reply = post(base, "/v1/completions", {"prompt": "hi", **EXACT})
        assert reply["usage"]["completion_tokens"] == EXACT["max_tokens"]
        assert up.alive()
        assert up.stop(signal.SIGTERM, timeout=90) == 0
    finally:
        up.stop(signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux parent-death signal")
def test_killed_up_takes_its_worker_gateway_and_redis_with_it(tmp_path):
    """SIGKILL gives `up` no chance to stop its parts; the kernel's parent-death signal does, so
    its worker, gateway and private redis-server all exit within a bounded time."""
    port = free_port()
    up = start_up(port, tmp_path)
    base = f"http://127.0.0.1:{port}"
    parts: set[processes.Proc] = set()
    try:
        wait_until_ready(up, base)
        parts = processes.service_processes(root=up.proc.pid)
        names = sorted(p.name for p in parts)
        assert names == ["jitney gateway", "jitney worker", "redis-server"], parts
        up.stop(signal.SIGKILL)
        wait_for(
            lambda: not any(processes.alive(p) for p in parts),
            PARTS_EXIT_S,
            f"{', '.join(names)} to exit after jitney up was killed",
        )
    finally:
        up.stop(signal.SIGKILL)
        processes.kill(parts)  # whatever failed, leave nothing running


def top_once(runtime_dir: Path) -> subprocess.CompletedProcess[str]:
    """`jitney top --once` as a user types it in a second terminal: no REDIS_URL."""
    env = {**os.environ, "REDIS_URL": "", "COLUMNS": "160", **runtime_env(runtime_dir)}
    return subprocess.run(
        [sys.executable, "-m", "jitney.cli", "top", "--once"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_top_beside_up_shows_the_worker_of_its_private_redis(tmp_path):
    """`jitney top --once` without REDIS_URL reads the private Redis of the `jitney up` running
    (not the default Redis) and shows its live worker; once `up` stops, its file is gone."""
    port = free_port()
    up = start_up(port, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(up, base)
        private = private_redis_url(up)
        wait_for(lambda: "1 worker(s)" in top_once(tmp_path).stdout, 30, "top to see the worker")
        top = top_once(tmp_path)
        assert top.returncode == 0, top.stderr
        head, *rows = top.stdout.splitlines()
        assert private.removeprefix("redis://") in head and "1 worker(s)" in head, head
        assert "no live workers" not in rows
        assert any(re.search(r" run +0/\d+ ", row) for row in rows), top.stdout
        (state,) = (tmp_path / "jitney").glob("up-*.json")
        assert json.loads(state.read_text())["redis_url"] == private
        assert up.stop(signal.SIGTERM, timeout=90) == 0
    finally:
        up.stop(signal.SIGKILL)
    assert not state.exists(), "jitney up left its file behind"
    assert private.removeprefix("redis://") not in top_once(tmp_path).stdout
