"""`jitney up`: everything on one machine: Redis (private unless REDIS_URL), a gateway, N workers.

Each part runs as its own process, exactly as in a cluster (`jitney gateway`, `jitney worker`);
this command starts them, shows the model loading, prints where to send requests, restarts a part
that dies (as Kubernetes would: a dead worker's requests are meanwhile taken over by the others,
or by its replacement), and stops everything in reverse order on Ctrl-C. Killed outright, it
takes its parts along (on Linux: see `die_with_parent`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

from engine.threads import ThreadChoice, resolve_threads
from gateway.config import GatewayConfig
from jitney.commands.engine_args import add_engine_arguments, engine_args_to_argv
from jitney.commands.local_stack import LocalStack, published
from jitney.commands.lora_args import lora_fields
from jitney.commands.worker import (
    METRICS_PORT,
    add_generation_config_arguments,
    generation_config_argv,
)
from jitney.flag_defaults import field_defaults
from launch.private_redis import die_with_parent, private_redis
from protocol import redacted, redis_url

READY_TIMEOUT_S = 600  # the first start may convert the bundled GGUF model (about a minute)
# A part that dies this many times within CRASH_WINDOW_S is crash-looping: stop everything.
MAX_RESTARTS = 5
CRASH_WINDOW_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    p.add_argument(
        "--port", type=int, default=field_defaults(GatewayConfig)["port"], help="gateway port"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_PORT,
        help="first worker's metrics port (worker i uses this + i)",
    )
    add_generation_config_arguments(p)
    add_engine_arguments(p)


@dataclass
class Part:
    """One jitney process (`jitney worker ...` or `jitney gateway ...`), restartable; its output
    is echoed with a name prefix."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[str] | None = None
    crashes: list[float] = field(default_factory=list)  # monotonic times of unexpected exits

    def start(self) -> None:
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-m", "jitney.cli", *self.argv],
            env=self.env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )

        def echo() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(f"[{self.name}] {line}", end="", flush=True)

        threading.Thread(target=echo, daemon=True).start()
        print(f"started {self.name} pid={proc.pid}", flush=True)

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def restart_if_dead(self) -> bool:
        """Restart the part if it died; False when it is crash-looping (give up)."""
        if not self.exited:
            return True
        assert self.proc is not None
        now = time.monotonic()
        self.crashes = [t for t in self.crashes if now - t < CRASH_WINDOW_S] + [now]
        print(f"{self.name} exited with {self.proc.returncode}", file=sys.stderr, flush=True)
        if len(self.crashes) > MAX_RESTARTS:
            print(
                f"{self.name} keeps dying ({len(self.crashes)} times in "
                f"{CRASH_WINDOW_S:g} s); stopping",
                file=sys.stderr,
                flush=True,
            )
            return False
        self.start()
        print(f"restarted {self.name}", flush=True)
        return True

    def stop(self) -> None:
        """SIGTERM (the part drains), then kill if it does not exit in time."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def running(parts: list[Part]) -> Iterator[list[Part]]:
    """Start the parts in order; stop them in reverse order, whatever happens."""
    started: list[Part] = []
    try:
        for part in parts:
            part.start()
            started.append(part)
        yield parts
    finally:
        for part in reversed(started):
            part.stop()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _interrupt(signum: int, frame: object) -> None:
    # Stop once: a second signal must not cut the parts' orderly shutdown short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("\nstopping ...", flush=True)
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    # SIGTERM (kill, docker stop) stops everything as Ctrl-C does; SIGINT is set explicitly
    # because a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        return _run(args)
    except KeyboardInterrupt:  # the parts started so far were stopped, in reverse order
        return 0


def worker_threads(choice: ThreadChoice, workers: int) -> ThreadChoice:
    """Each worker's threads: a number the user gave (--threads, OMP_NUM_THREADS) is each
    worker's; the automatic one is shared, so the workers together take what the process may
    use. Nothing is kept back for the gateway and Redis: they wait on sockets, and what they
    need beside a busy worker is still to be measured (issue 56); --threads leaves them room."""
    if not choice.automatic or workers <= 1:
        return choice
    count = max(1, choice.count // workers)
    return replace(choice, count=count, reason=f"{choice.reason}, shared by {workers} workers")


def _run(args: argparse.Namespace) -> int:
    try:  # before anything starts: a bad OMP_NUM_THREADS is refused here, not by each worker
        threads = worker_threads(resolve_threads(args.threads), args.workers)
        lora_fields(args)  # an adapter named twice: refused once, not by each worker in a loop
    except ValueError as e:
        print(f"up: {e}", file=sys.stderr)
        return 2
    # The workers resolve the same rule themselves (same CPUs, same cgroup): only a share
    # differs from what one worker would pick alone, and only it is passed on.
    share = ["--threads", str(threads.count)] if threads.automatic and args.workers > 1 else []
    print(f"worker threads: {threads.count} each ({threads.reason})", flush=True)
    with ExitStack() as stack:
        external = os.environ.get("REDIS_URL")
        url = external or stack.enter_context(private_redis())
        host = "localhost" if args.host in ("0.0.0.0", "127.0.0.1") else args.host
        base = f"http://{host}:{args.port}"
        if external:
            print(f"using Redis at {redacted(redis_url())}")
        else:
            print(f"started a private redis-server at {url}")
            # So `jitney top` beside us, without REDIS_URL, reads this Redis.
            stack.enter_context(published(LocalStack(os.getpid(), url, base)))
        # `up` turns its own options into the children's flags; its JITNEY_* variables must not
        # reach them too (JITNEY_METRICS_PORT would make the gateway bind worker 0's port).
        own = {f"JITNEY_{name.upper()}" for name in vars(args)}
        env = {k: v for k, v in os.environ.items() if k not in own}
        env |= {"REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
        workers = [
            Part(
                f"worker-{i}",
                [
                    "worker",
                    *engine_args_to_argv(args),
                    *share,
                    *generation_config_argv(args),
                    "--metrics-port",
                    str(args.metrics_port + i),
                ],
                env,
            )
            for i in range(args.workers)
        ]
        gateway = Part("gateway", ["gateway", "--host", args.host, "--port", str(args.port)], env)
        parts = stack.enter_context(running([*workers, gateway]))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(base):
            if any(part.exited for part in parts):
                print("a part exited during start-up; stopping", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"not ready after {READY_TIMEOUT_S} s; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(_banner(base, args, threads), flush=True)
        while all(part.restart_if_dead() for part in parts):
            time.sleep(0.5)
        return 1


def _banner(base: str, args: argparse.Namespace, threads: ThreadChoice) -> str:
    question = '{"role": "user", "content": "What is the capital of France?"}'
    return f"""
Jitney is up: {args.workers} worker(s) serving {args.model}, {threads.count} thread(s) each
  OpenAI API   {base}/v1
  metrics      {base}/metrics (gateway), http://localhost:{args.metrics_port}/metrics (worker 0)

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{args.model}", "messages": [{question}]}}'

Press Ctrl-C to stop.
"""
