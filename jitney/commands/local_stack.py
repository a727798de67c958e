"""Where the stack `jitney up` started can be found, so `jitney top` run beside it reads the same
Redis.

`jitney up` with a private redis-server writes one small JSON file, `up-<pid>.json`, in the
user's runtime directory ($XDG_RUNTIME_DIR/jitney, else ~/.cache/jitney/run) and removes it when
it exits. A file whose `up` is gone (killed outright) is stale: readers skip it and delete it.
Only a private Redis is recorded: an operator's REDIS_URL may hold a password, and whoever set it
can give it to `jitney top` too.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LocalStack:
    pid: int  # the `jitney up` process
    redis_url: str
    gateway_url: str


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/jitney (per user, private, emptied at logout), else ~/.cache/jitney/run."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "jitney"
    return Path.home() / ".cache" / "jitney" / "run"


@contextlib.contextmanager
def published(stack: LocalStack) -> Iterator[Path | None]:
    """The stack's file, there while the block runs (readable by this user only). None where it
    cannot be written (a read-only home): the stack runs all the same, `top` just cannot find it."""
    path = runtime_dir() / f"up-{stack.pid}.json"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(stack), f)
    except OSError:
        yield None
        return
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def live_stacks() -> list[LocalStack]:
    """The stacks whose `jitney up` still runs, oldest file first; stale files are removed."""
    directory = runtime_dir()
    paths = sorted(directory.glob("up-*.json"), key=_mtime) if directory.is_dir() else []
    stacks = []
    for path in paths:
        try:
            stack = LocalStack(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):  # half-written or foreign: not ours to read
            continue
        if _alive(stack.pid):
            stacks.append(stack)
        else:
            path.unlink(missing_ok=True)
    return stacks


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True
