"""The processes a benchmark starts for itself: `jitney` parts with their output in log files,
stopped politely, and waited for until the gateways serve the model and every worker is ready
(`jitney bench queue`, `jitney bench placement`), or a whole `jitney up` (`jitney bench busy`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from launch.private_redis import free_port


@dataclass(slots=True)
class Part:
    name: str
    proc: subprocess.Popen[bytes]
    log: str  # its output
    metrics_port: int | None = None
    url: str | None = None


def start_part(
    name: str,
    args: list[str],
    env: dict[str, str],
    workdir: str,
    metrics_port: int | None = None,
    url: str | None = None,
) -> Part:
    """`jitney <args>` with its output in `workdir`/<name>.log."""
    path = os.path.join(workdir, f"{name}.log")
    with open(path, "wb") as log:  # the child keeps its copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "jitney.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Part(name, proc, path, metrics_port, url)


def stop_part(part: Part, timeout: float = 30) -> None:
    proc = part.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_serving(parts: list[Part], model: str, what: str, timeout: float = 120) -> None:
    """Every gateway lists `model` and every worker answers /ready; a part that exits first
    raises with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in parts if p.proc.poll() is not None]
        if dead:
            tail = Path(dead[0].log).read_text(errors="replace")[-2000:]
            names = ", ".join(p.name for p in dead)
            raise RuntimeError(f"{what}: {names} exited during start-up:\n{tail}")
        gateways = [p for p in parts if p.url]
        if all(model in _get(f"{g.url}/v1/models") for g in gateways) and all(
            _get(f"http://127.0.0.1:{p.metrics_port}/ready") for p in parts if p.metrics_port
        ):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what}: the stack did not come up in time")


def _get(url: str) -> str:
    """The body of a 200 answer, "" otherwise."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.read().decode(errors="replace") if resp.status == 200 else ""
    except OSError:
        return ""


@contextmanager
def jitney_up(flags: list[str], workdir: str, timeout: float = 600) -> Iterator[str]:
    """`jitney up <flags>` as a user starts it (its own private Redis, a gateway, a worker) on
    free ports; yields the gateway's URL once it lists a model, stops the stack on exit."""
    port, metrics = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # up's own Redis
    args = ["up", *flags, "--port", str(port), "--metrics-port", str(metrics)]
    url = f"http://127.0.0.1:{port}"
    part = start_part("up", args, env, workdir, metrics_port=metrics, url=url)
    try:
        deadline = time.monotonic() + timeout
        while '"id"' not in _get(f"{url}/v1/models"):
            if part.proc.poll() is not None:
                tail = Path(part.log).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"jitney up exited during start-up:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"jitney up not serving after {timeout:g} s")
            time.sleep(0.2)
        yield url
    finally:
        stop_part(part, timeout=120)  # up drains and stops its parts first
