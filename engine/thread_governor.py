"""The compute thread count, kept to the CPUs other processes leave free (engine/threads.py
decides the count at start; this follows the machine after).

A step splits each op across torch's intra-op threads, and every op ends at a barrier. When
another process keeps one of our CPUs busy, the thread scheduled beside it runs in time slices
of a few milliseconds, and every barrier waits for its next slice: on 2 cores beside one
spinning process a served decode step took 46x its quiet time, where giving up that core costs
about half. So the engine asks, four times a second, how much of the allowed CPUs other work wants:
what it got, the CPUs' busy time (/proc/stat, steal included: a VM's host taking them counts)
less this process's own (its threads, spinning ones included), plus what it took from us, the
time our threads waited on a run queue (/proc/self/task/*/schedstat). A CPU counts as taken
where that comes to three quarters of one or more, and the thread count is the automatic count
less the taken CPUs, at least one. Going back up needs no probe: once the other work stops, the
CPUs it left show idle and the count returns at the next reading.

Only an automatic count adapts: `--threads` and OMP_NUM_THREADS are the operator's and stay.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.threads import ThreadChoice

logger = logging.getLogger("jitney.engine.threads")

INTERVAL_S = 0.25  # how often the CPUs are read: a short request sees a taken core within ~0.5 s
TAKEN_AT = 0.75  # the share of a CPU others must keep busy for it to count as taken
# /proc/stat's fields after the CPU's name: user nice system idle iowait irq softirq steal; the
# busy ones (guest time is already in user).
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """At a moment: seconds the allowed CPUs were busy, this process's CPU seconds, and the
    seconds its threads waited on a run queue."""

    at: float
    cpus_busy_s: float
    own_s: float
    waited_s: float


def read_sample(cpus: set[int], proc: Path = Path("/proc")) -> CpuSample:
    """The busy time of `cpus` (/proc/stat, clock ticks), this process's CPU time and its
    threads' run-queue wait (schedstat, nanoseconds)."""
    ticks = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in (proc / "stat").read_text().splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = rest.split()
        busy += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    times = os.times()
    waited = 0
    for task in (proc / "self" / "task").iterdir():
        try:
            waited += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return CpuSample(time.monotonic(), busy / ticks, times.user + times.system, waited / 1e9)


def taken_cpus(before: CpuSample, after: CpuSample) -> int:
    """CPUs other work wants between two samples, each at least TAKEN_AT of one: the busy time
    that was not ours, and the time our threads waited for a CPU."""
    wall = after.at - before.at
    if wall <= 0:
        return 0
    got = (after.cpus_busy_s - before.cpus_busy_s) - (after.own_s - before.own_s)
    took = after.waited_s - before.waited_s
    return max(0, math.floor((got + took) / wall + (1 - TAKEN_AT)))


@dataclass(slots=True)
class ThreadGovernor:
    """Keeps the thread count at `base` less the CPUs others take; `apply` sets it (torch's)."""

    base: int
    cpus: set[int]
    apply: Callable[[int], None]
    sample: Callable[[], CpuSample]
    count: int = 0
    _last: CpuSample | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.count = self.base

    def tick(self) -> int | None:
        """Read the CPUs if INTERVAL_S has passed; the new count where it changed, else None."""
        now = time.monotonic()
        if self._last is not None and now - self._last.at < INTERVAL_S:
            return None
        current = self.sample()
        last, self._last = self._last, current
        if last is None:
            return None
        taken = taken_cpus(last, current)
        target = max(1, self.base - taken)
        if target == self.count:
            return None
        logger.info(
            "threads: %d (others keep %d of the %d CPUs busy; the automatic count is %d)",
            target, taken, len(self.cpus), self.base,
        )  # fmt: skip
        self.count = target
        self.apply(target)
        return target


_governor: ThreadGovernor | None = None


def govern(choice: ThreadChoice, cpus: set[int]) -> None:
    """From now on, keep an automatic thread count to the CPUs left free (an operator's count
    stays as given). The engine's steps call `adapt`."""
    global _governor
    if not choice.automatic or choice.count < 2 or not Path("/proc/self/task").is_dir():
        _governor = None
        return
    import torch

    allowed = set(cpus)
    _governor = ThreadGovernor(
        choice.count, allowed, torch.set_num_threads, lambda: read_sample(allowed)
    )


def adapt() -> None:
    """A step's check: nothing unless a governor runs and its interval has passed."""
    if _governor is not None:
        _governor.tick()
