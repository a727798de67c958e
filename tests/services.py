"""Real services for tests: a private redis-server on a free port, and jitney processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from protocol import Keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2) -> int:
    """The HTTP status of a GET, error statuses included; OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def serving(base: str, api_key: str | None = None) -> bool:
    """The gateway at `base` is ready and lists a model. /ready alone is not enough before a
    request: it reads the worker heartbeats in Redis, while the request path reads the model
    registry, which finds a new worker's card up to its miss re-read interval (0.5 s) later and
    answers 503 no_workers meanwhile."""
    if http_status(f"{base}/ready") != 200:
        return False
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{base}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=2) as response:
        return bool(json.load(response)["data"])


# What a service not up yet (or restarting) answers: connection refused or reset, a 503 (urllib's
# HTTPError is an OSError), Redis loading or not listening. Only these mean "not yet".
TRANSIENT: tuple[type[Exception], ...] = (OSError, redis.ConnectionError, redis.TimeoutError)


def wait_for(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.05,
    transient: tuple[type[Exception], ...] = TRANSIENT,
) -> None:
    """Poll `check` until it returns true. A `transient` error counts as "not yet"; any other
    exception (above all an assertion in `check`, such as `assert proc.alive(), proc.output()`)
    fails at once, so a crashed process costs no timeout and shows its log."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            if check():
                return
            last = None
        except transient as e:
            last = e
        if time.monotonic() >= deadline:
            detail = f" (last error: {type(last).__name__}: {last})" if last else ""
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(interval)


class RedisServer:
    """A private redis-server the test owns: it can be stopped, killed and restarted."""

    def __init__(
        self, port: int | None = None, appendonly: bool = False, extra_args: tuple[str, ...] = ()
    ):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: `make install` installs it (Debian)")
        self.binary = binary
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = extra_args
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
            *self.extra_args,
        ]
        with open(self.dir / "redis.log", "ab") as log:  # its log goes to stdout
            self.proc = proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert proc.poll() is None, f"redis-server exited:\n{self.output()}"
            return bool(self.client().ping())

        wait_for(up, 10, f"redis-server on port {self.port}")
        return self

    def output(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

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

    def metric(self, name: str, *, required: bool = False, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none; with
        `required`, none fails the test)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            # A dead worker fails the test with its log at once (in wait_for too), rather than
            # being polled until a timeout.
            assert self.proc.alive(), f"{self.worker_id} exited:\n{self.proc.output()}"
            raise
        values = [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        ]
        assert values or not required, f"{self.worker_id} exports no {name} {labels}"
        return sum(values)


def start_worker(
    server: RedisServer,
    worker_id: str,
    *flags: str,
    model: str = "tiny-random",
    env: dict[str, str] | None = None,
) -> Worker:
    port = free_port()
    args = [
        "worker",
        "--model",
        model,
        "--kv-cache-memory",
        "16MiB",
        "--metrics-port",
        str(port),
        "--worker-id",
        worker_id,
        *flags,
    ]
    # One torch thread each: several workers and the test share two cores.
    full_env = {"REDIS_URL": server.url, "OMP_NUM_THREADS": "1", **(env or {})}
    return Worker(JitneyProcess(args, full_env, name=worker_id), worker_id, port)


def start_gateway(server: RedisServer, *flags: str, env: dict[str, str] | None = None) -> Gateway:
    port = free_port()
    proc = JitneyProcess(
        ["gateway", "--host", "127.0.0.1", "--port", str(port), *flags],
        {"REDIS_URL": server.url, **(env or {})},
        name="gateway",
    )
    return Gateway(proc, f"http://127.0.0.1:{port}")


@dataclass
class Gateway:
    proc: JitneyProcess
    base: str

    def wait_ready(self, timeout: float = 60, api_key: str | None = None) -> None:
        def ready() -> bool:
            assert self.proc.alive(), self.proc.output()
            return serving(self.base, api_key)

        wait_for(ready, timeout, "gateway /ready and a model listed")


@dataclass
class System:
    server: RedisServer
    gateway: Gateway
    workers: list[Worker]

    @property
    def base(self) -> str:
        return self.gateway.base


def wait_ready(r: redis.Redis, *workers: Worker, timeout: float = 90) -> None:
    """A worker is ready once its heartbeat is in the workers set."""
    for w in workers:

        def up(w: Worker = w) -> bool:
            assert w.proc.alive(), f"{w.worker_id} exited:\n{w.proc.output()}"
            return r.zscore(Keys().workers, w.worker_id) is not None

        wait_for(up, timeout, f"{w.worker_id} heartbeat")


@contextmanager
def running_system(
    worker_ids: tuple[str, ...] = ("w1",),
    worker_flags: tuple[str, ...] = (),
    worker_env: dict[str, str] | None = None,
    appendonly: bool = False,
    gateway_flags: tuple[str, ...] = (),
    api_key: str | None = None,
) -> Iterator[System]:
    """A private redis-server, tiny-random `jitney worker`s and a `jitney gateway`, all ready;
    stops everything afterwards (whatever the test killed already)."""
    server = RedisServer(appendonly=appendonly).start()
    workers = [start_worker(server, w, *worker_flags, env=worker_env) for w in worker_ids]
    gateway = start_gateway(server, *gateway_flags)
    try:
        wait_ready(server.client(), *workers)
        gateway.wait_ready(api_key=api_key)
        yield System(server, gateway, workers)
    finally:
        gateway.proc.stop()
        for worker in workers:
            worker.proc.stop()
        server.close()


@contextmanager
def running_stack(worker_id: str = "w1") -> Iterator[tuple[str, Worker]]:
    """running_system with one worker: yields the gateway's base URL and the worker."""
    with running_system((worker_id,)) as system:
        yield system.base, system.workers[0]
