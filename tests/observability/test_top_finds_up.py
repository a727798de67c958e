"""Which Redis `jitney top` reads: REDIS_URL, else the one `jitney up` running here left its file
for, else the default (tests/service/test_up.py runs it beside a real `jitney up`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jitney.commands.local_stack import LocalStack, live_stacks, published, runtime_dir
from jitney.commands.top import redis_to_read
from protocol.keys import DEFAULT_REDIS_URL


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    return tmp_path / "jitney"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stack(pid: int, port: int) -> LocalStack:
    return LocalStack(pid, f"redis://127.0.0.1:{port}/0", "http://localhost:8000")


def test_the_file_is_private_and_gone_after_up(runtime: Path) -> None:
    """Written in the runtime directory for this user only, removed when the block ends."""
    with published(stack(os.getpid(), 7001)) as path:
        assert runtime_dir() == runtime and path.parent == runtime
        assert path.stat().st_mode & 0o777 == 0o600
        assert json.loads(path.read_text())["redis_url"] == "redis://127.0.0.1:7001/0"
        assert live_stacks() == [stack(os.getpid(), 7001)]
    assert not path.exists() and live_stacks() == []


def test_a_stale_file_is_skipped_and_removed(runtime: Path) -> None:
    """A `jitney up` killed outright leaves its file; its pid is gone, so nobody reads it."""
    runtime.mkdir(parents=True)
    stale = runtime / "up-1.json"
    stale.write_text(
        json.dumps({"pid": dead_pid(), "redis_url": "redis://x:1/0", "gateway_url": ""})
    )
    (runtime / "up-2.json").write_text("{not json")  # half written: skipped, left alone
    assert live_stacks() == []
    assert not stale.exists()
    assert redis_to_read() == DEFAULT_REDIS_URL


def test_top_reads_redis_url_first_then_up_then_the_default(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert redis_to_read() == DEFAULT_REDIS_URL
    with published(stack(os.getpid(), 7002)):
        assert redis_to_read() == "redis://127.0.0.1:7002/0"
        monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")
        assert redis_to_read() == "redis://elsewhere:6379/0"


def test_with_several_ups_top_asks_which(runtime: Path) -> None:
    """Two live stacks: top names both and reads neither."""
    parent = os.getppid()  # alive, and not this process: a second `up`
    with (
        published(stack(os.getpid(), 7003)),
        published(stack(parent, 7004)),
        pytest.raises(SystemExit) as refused,
    ):
        redis_to_read()
    message = str(refused.value)
    assert "2 `jitney up` are running" in message
    assert "REDIS_URL=redis://127.0.0.1:7003/0" in message
    assert "REDIS_URL=redis://127.0.0.1:7004/0" in message


def test_an_unwritable_runtime_directory_costs_only_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`jitney up` must run where its file cannot be written; `top` then finds nothing."""
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory should be: mkdir fails
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr("jitney.commands.local_stack.runtime_dir", lambda: blocked / "jitney")
    with published(stack(os.getpid(), 7005)) as path:
        assert path is None
        assert live_stacks() == []
