"""A busy machine on demand: one process spinning on a CPU (`python -c "while True: pass"`), the
unrelated program a laptop, a shared VM or a busy Kubernetes node runs beside a server. Pinned to
one CPU (`cpu`) it takes that core; unpinned, the kernel's scheduler places it as it would any
other process. `jitney bench busy` starts one for each busy measurement and stops it after.

Each spinner leaves a record: its pid and CPU, how long it ran and how much CPU time it got
(evidence it really spun), and that it was stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from launch.private_redis import die_with_parent

# It says it is spinning (one byte out) so the measurement starts with the CPU already taken,
# not while an interpreter starts up.
SPIN = "import os; os.write(1, b'.')\nwhile True: pass"


@dataclass(slots=True)
class SpinnerRecord:
    pid: int
    cpu: int | None  # None: not pinned
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the CPU time it got while it ran
    stopped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Spinner:
    """A context manager: a spinning process while the block runs, killed when it ends (and by
    the kernel if this process dies first, on Linux)."""

    def __init__(self, cpu: int | None = None) -> None:
        self.cpu = cpu
        self.proc: subprocess.Popen[bytes] | None = None
        self.record: SpinnerRecord | None = None
        self._started = 0.0

    def __enter__(self) -> Spinner:
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-c", SPIN],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            preexec_fn=_preexec(self.cpu),
        )
        assert proc.stdout is not None
        proc.stdout.read(1)  # spinning now
        self._started = time.monotonic()
        self.record = SpinnerRecord(self.proc.pid, self.cpu)
        return self

    def __exit__(self, *exc: object) -> None:
        proc, record = self.proc, self.record
        assert proc is not None and record is not None
        record.cpu_s = _cpu_seconds(proc.pid)
        record.wall_s = round(time.monotonic() - self._started, 3)
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        record.stopped = proc.returncode == -signal.SIGKILL


def _preexec(cpu: int | None) -> Callable[[], None]:
    parent_death = die_with_parent()

    def setup() -> None:
        if parent_death is not None:
            parent_death()
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    return setup


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (0 where there is none)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return round(ticks / os.sysconf("SC_CLK_TCK"), 3)
