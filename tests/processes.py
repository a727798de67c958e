"""The test run's service processes (jitney, redis-server, prometheus, nginx), found through
/proc, and the leak check tests/conftest.py runs after every test.

The run's processes are the descendants of pytest. So that orphans stay among them (the parts
of a killed `jitney up` are re-parented, to init by default), pytest makes itself a child
subreaper. Linux only: elsewhere there is no /proc and nothing is found.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from launch.private_redis import libc_prctl

PROC = Path("/proc")
SERVERS = frozenset({"redis-server", "prometheus", "nginx"})  # as /proc/<pid>/comm names them
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


@dataclass(frozen=True)
class Proc:
    """One process; (pid, start) names it even after its pid is reused (and its command line
    may change: redis-server rewrites its own)."""

    pid: int
    start: int  # clock ticks after boot
    name: str = field(compare=False)  # "redis-server", "jitney worker", ...
    cmdline: str = field(compare=False)

    def __str__(self) -> str:
        return f"pid {self.pid} {self.name}: {self.cmdline[:200]}"


@dataclass(frozen=True)
class _Stat:
    comm: str
    state: str
    ppid: int
    start: int


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init, so they still
    count as the run's (they stay zombies once they exit: harmless, and seen as gone)."""
    prctl = libc_prctl()
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1) == 0


def _stat(pid: int) -> _Stat | None:
    """/proc/<pid>/stat, or None when the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The comm is in parentheses and may contain anything: split after the last ')'.
    end = text.rindex(")")
    fields = text[end + 2 :].split()
    return _Stat(text[text.index("(") + 1 : end], fields[0], int(fields[1]), int(fields[19]))


def _service_name(comm: str, argv: list[str]) -> str | None:
    """What kind of service the process is, or None for anything else."""
    if comm in SERVERS:
        return comm
    if "jitney.cli" in argv:  # `python -m jitney.cli <command>`, as tests and `up` start them
        rest = argv[argv.index("jitney.cli") + 1 :]
        return f"jitney {rest[0] if rest else ''}".strip()
    if argv and Path(argv[0]).name == "jitney":
        return f"jitney {argv[1] if len(argv) > 1 else ''}".strip()
    return None


def service_processes(root: int | None = None) -> set[Proc]:
    """Live service processes below `root` (this process by default). Zombies count as gone:
    they have exited."""
    root = os.getpid() if root is None else root
    if not PROC.is_dir():
        return set()
    stats = {
        int(e.name): s for e in PROC.iterdir() if e.name.isdigit() and (s := _stat(int(e.name)))
    }
    found = set()
    for pid, stat in stats.items():
        if stat.state in "ZX" or not _descends(pid, root, stats):
            continue
        try:
            raw = (PROC / str(pid) / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        argv = [a for a in raw.decode(errors="replace").split("\0") if a]
        name = _service_name(stat.comm, argv)
        if name is not None:
            found.add(Proc(pid, stat.start, name, " ".join(argv)))
    return found


def _descends(pid: int, root: int, stats: dict[int, _Stat]) -> bool:
    seen = set()
    while pid in stats and pid not in seen:
        seen.add(pid)
        pid = stats[pid].ppid
        if pid == root:
            return True
    return False


def alive(proc: Proc) -> bool:
    """Still running (not a zombie), and the same process, not a new one with its pid."""
    stat = _stat(proc.pid)
    return stat is not None and stat.state not in "ZX" and stat.start == proc.start


def kill(procs: set[Proc]) -> None:
    """SIGKILL what a test leaked, so one leak does not leave servers behind for the run; reap
    those that are (or were adopted as) this process' children, zombies included."""
    for proc in procs:
        if alive(proc):
            with contextlib.suppress(OSError):  # it exited meanwhile
                os.kill(proc.pid, signal.SIGKILL)
        stat = _stat(proc.pid)
        if stat is not None and stat.start == proc.start:  # not reaped yet
            with contextlib.suppress(ChildProcessError):  # another process' child
                os.waitpid(proc.pid, 0)


@dataclass
class LeakWatch:
    """The run's service processes, each charged to the test during which it started. One still
    alive when the scope that may hold it ends (its module: module-scoped fixtures run servers
    across tests) was leaked: it is reported with that test's name, and killed."""

    started: dict[Proc, str] = field(default_factory=dict)
    current: str = ""  # the test being run
    closed: bool = False

    def after_test(self, scope_ends: bool) -> str | None:
        """Called after each test's teardown; a report of what leaked, or None."""
        running = service_processes()
        self.started = {p: self.started.get(p, self.current) for p in running}
        if not scope_ends or not self.started:
            return None
        leaked, self.started = self.started, {}
        kill(set(leaked))
        rows = sorted(f"  {proc}\n    started during {test}" for proc, test in leaked.items())
        return "service processes outlived their test (now killed):\n" + "\n".join(rows)
