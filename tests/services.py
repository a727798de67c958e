"""Real services for tests: a private redis-server on a free port, and jitney processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from jitney.protocol import Keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


class RedisServer:
    """A private redis-server the test owns: it can be stopped, killed and restarted."""

    def __init__(self, port: int | None = None, appendonly: bool = False):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: `make install` installs it (Debian)")
        self.binary = binary
        self.port = port or free_port()
        self.appendonly = appendonly
        self.dir = Path(tempfile.mkdtemp(prefix="jitney-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.dir),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.client().ping(), 10, f"redis-server on port {self.port}")
        return self

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class JitneyProcess:
    """`jitney <args>` in a subprocess, with its output in a log file for failing tests."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, name: str = "jitney"):
        self.args = args
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"jitney-{name}-", suffix=".log")[1])
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jitney.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@dataclass
class Worker:
    proc: JitneyProcess
    worker_id: str
    metrics_port: int

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


def start_worker(
    server: RedisServer, worker_id: str, *flags: str, model: str = "tiny-random"
) -> Worker:
    port = free_port()
    args = ["worker", "--model", model, "--kv-cache-memory", "16MiB", "--metrics-port", str(port),
            "--worker-id", worker_id, *flags]  # fmt: skip
    # One torch thread each: several workers and the test share two cores.
    env = {"REDIS_URL": server.url, "OMP_NUM_THREADS": "1"}
    return Worker(JitneyProcess(args, env, name=worker_id), worker_id, port)


def wait_ready(r: redis.Redis, *workers: Worker, timeout: float = 90) -> None:
    """A worker is ready once its heartbeat is in the workers set."""
    for w in workers:

        def up(w: Worker = w) -> bool:
            assert w.proc.alive(), f"{w.worker_id} exited:\n{w.proc.output()}"
            return r.zscore(Keys().workers, w.worker_id) is not None

        wait_for(up, timeout, f"{w.worker_id} heartbeat")


@contextmanager
def running_stack(worker_id: str = "w1") -> Iterator[tuple[str, Worker]]:
    """A private redis-server, one tiny-random `jitney worker` and a `jitney gateway`, all
    ready; yields the gateway's base URL and the worker, and stops everything afterwards."""
    server = RedisServer().start()
    worker = start_worker(server, worker_id)
    port = free_port()
    gateway = JitneyProcess(
        ["gateway", "--host", "127.0.0.1", "--port", str(port)],
        {"REDIS_URL": server.url},
        name="gateway",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server.client(), worker)

        def ready() -> bool:
            assert gateway.alive(), gateway.output()
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as resp:
                return resp.status == 200

        wait_for(ready, 60, "gateway /ready")
        yield base, worker
    finally:
        gateway.stop()
        worker.proc.stop()
        server.close()
