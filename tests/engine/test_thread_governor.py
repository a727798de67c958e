"""engine/thread_governor.py: the automatic thread count follows the CPUs other processes leave
free. The arithmetic on samples, the governor's steps on a sequence of them, /proc read from a
temp tree laid out as /proc is, and a real spinning process seen as a taken CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import thread_governor
from engine.thread_governor import CpuSample, ThreadGovernor, read_sample, taken_cpus
from engine.threads import AFFINITY, FLAG, ThreadChoice


def sample(at: float, busy: float, own: float, waited: float = 0.0) -> CpuSample:
    return CpuSample(at, busy, own, waited)


def test_a_cpu_is_taken_by_what_others_got_and_what_they_took_from_us() -> None:
    """Others' share: busy time not ours, plus our threads' run-queue wait; a CPU counts from
    three quarters of one."""
    quiet = sample(1.0, 2.0, 2.0)  # both CPUs ours
    assert taken_cpus(sample(0.0, 0.0, 0.0), quiet) == 0
    # A spinner sharing our second CPU: it got 0.6 of a CPU, our threads waited 0.5 s a second.
    assert taken_cpus(sample(0.0, 0.0, 0.0), sample(1.0, 2.0, 1.4, 0.5)) == 1
    # At one thread beside the spinner: it has its CPU, we have ours, nobody waits.
    assert taken_cpus(sample(0.0, 0.0, 0.0), sample(1.0, 2.0, 1.0)) == 1
    # A gateway and Redis using a fifth of a CPU: nothing taken.
    assert taken_cpus(sample(0.0, 0.0, 0.0), sample(1.0, 1.9, 1.7, 0.02)) == 0
    assert taken_cpus(sample(0.0, 0.0, 0.0), sample(1.0, 1.7, 1.0, 0.0)) == 0  # 0.7 < 0.75
    assert taken_cpus(sample(1.0, 0.0, 0.0), sample(1.0, 2.0, 0.0)) == 0  # no time passed


def test_the_governor_gives_up_a_taken_cpu_and_takes_it_back_when_freed(monkeypatch) -> None:
    """Base 2: a spinner appears (count 1), stays (1), leaves (2); the count is applied once per
    change, and between intervals nothing is read."""
    clock = [0.0]
    monkeypatch.setattr(thread_governor.time, "monotonic", lambda: clock[0])
    readings = iter(
        [
            sample(0.0, 0.0, 0.0),
            sample(0.5, 1.0, 1.0),  # quiet: both CPUs ours
            sample(1.0, 2.0, 1.7, 0.25),  # a spinner: it got 0.6 of a CPU, took 0.25 s from us
            sample(1.5, 3.0, 2.2, 0.25),  # at one thread, the spinner on the other CPU
            sample(2.0, 3.5, 2.7, 0.25),  # the spinner gone: 0.5 s busy, all ours
        ]
    )
    applied: list[int] = []
    gov = ThreadGovernor(2, {0, 1}, applied.append, lambda: next(readings))
    assert gov.tick() is None  # the first reading only starts the window
    clock[0] = 0.2
    assert gov.tick() is None  # within the interval: no reading
    for at, want in ((0.5, None), (1.0, 1), (1.5, None), (2.0, 2)):
        clock[0] = at
        assert gov.tick() == want
    assert applied == [1, 2] and gov.count == 2


def test_proc_files_are_read_as_the_kernel_writes_them(tmp_path) -> None:
    """Busy ticks of the allowed CPUs only (user nice system irq softirq steal), and every
    thread's run-queue wait."""
    (tmp_path / "self" / "task" / "11").mkdir(parents=True)
    (tmp_path / "self" / "task" / "12").mkdir(parents=True)
    (tmp_path / "stat").write_text(
        "cpu  900 0 900 900 0 0 0 0 0 0\n"
        "cpu0 100 10 50 700 40 5 5 20 0 0\n"
        "cpu1 300 0 100 400 0 0 0 0 0 0\n"
        "cpu2 999 0 0 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    (tmp_path / "self" / "task" / "11" / "schedstat").write_text("1000 2000000000 7\n")
    (tmp_path / "self" / "task" / "12" / "schedstat").write_text("1000 500000000 3\n")
    s = read_sample({0, 1}, tmp_path)
    ticks = os.sysconf("SC_CLK_TCK")
    assert s.cpus_busy_s == pytest.approx((100 + 10 + 50 + 5 + 5 + 20 + 300 + 100) / ticks)
    assert s.waited_s == pytest.approx(2.5)


def test_only_an_automatic_count_is_governed() -> None:
    """An operator's --threads (or OMP_NUM_THREADS) stays as given; one thread has nothing to
    give up."""
    try:
        thread_governor.govern(ThreadChoice(2, FLAG, FLAG), {0, 1})
        assert thread_governor._governor is None
        thread_governor.govern(ThreadChoice(1, AFFINITY, "affinity: 1 CPU"), {0})
        assert thread_governor._governor is None
        thread_governor.govern(ThreadChoice(2, AFFINITY, "affinity: 2 CPUs"), {0, 1})
        assert thread_governor._governor is not None and thread_governor._governor.base == 2
    finally:
        thread_governor._governor = None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_spinning_process_reads_as_a_taken_cpu() -> None:
    """A real process spinning on one of our CPUs for a second is seen as one CPU taken (or
    more, where the suite's other process keeps the other busy)."""
    cpus = os.sched_getaffinity(0)
    spinner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {max(cpus)}),
    )
    try:
        time.sleep(0.3)  # it is spinning
        before = read_sample(cpus, Path("/proc"))
        time.sleep(1.0)
        assert taken_cpus(before, read_sample(cpus, Path("/proc"))) >= 1
    finally:
        spinner.kill()
        spinner.wait()
