"""A private redis-server for one tree of processes (`jitney up`, `jitney bench queue`): on a
free port, without persistence, stopped when the tree stops (on Linux even if its parent is
killed: `die_with_parent`)."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def libc_prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux only, else None), loaded once in the parent: a forked child should
    only call it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when `up` dies, however it dies
    (SIGKILL, OOM killer): the parts then stop as on Ctrl-C, only not in order, and nothing
    outlives `up`. Linux only (prctl PR_SET_PDEATHSIG); None elsewhere, where only an orderly
    stop (Ctrl-C, SIGTERM) stops the parts.

    The signal comes when the *thread* that started the child exits: `up` starts every part
    from its main thread."""
    prctl = libc_prctl()
    if prctl is None:
        return None
    parent, sig = os.getpid(), int(signal.SIGTERM)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # `up` died before prctl took effect: no signal will come
            os.kill(os.getpid(), sig)

    return preexec


@contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway redis-server on a free port (no persistence), stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "redis-server not found. Install Redis 7 or newer (Debian/Ubuntu: "
            "`apt-get install redis-server`; macOS: `brew install redis`), or set REDIS_URL."
        )
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="jitney-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a terminal's Ctrl-C reaches only `up`, which stops Redis last, after
        # the workers have delivered or handed back their requests.
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
