"""The compute thread count (engine/threads.py): --threads, then OMP_NUM_THREADS, then the
physical cores among the allowed CPUs capped by the cgroup CPU quota. The rules read real files
in a temp tree laid out as /proc/self, /sys/devices/system/cpu and /sys/fs/cgroup are; one test
runs `jitney generate` limited to one CPU, one a process in a real cgroup where it can."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engine.threads import (
    AFFINITY,
    CGROUP_V1,
    CGROUP_V2,
    FLAG,
    OMP,
    SystemPaths,
    parse_cpu_list,
    parse_thread_count,
    resolve_threads,
)

REPO = Path(__file__).resolve().parents[2]
FOUR = {0, 1, 2, 3}


def tree(tmp_path: Path, memberships: str, mounts: str = "") -> SystemPaths:
    """A /proc/self with these `cgroup` and `mountinfo` files; no CPU topology yet."""
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(memberships)
    (proc / "mountinfo").write_text(mounts)
    return SystemPaths(proc, tmp_path / "sys-cpu", tmp_path / "fallback")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def mountinfo_v2(point: Path) -> str:
    return (
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        f"30 22 0:26 / {point} rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
    )


def mountinfo_v1(root: str, point: Path) -> str:
    return (
        f"31 23 0:28 / {point.parent} rw - tmpfs tmpfs rw,mode=755\n"
        f"32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        f"33 31 0:30 / {point.parent / 'memory'} rw,relatime - cgroup cgroup rw,memory\n"
    )


def test_with_no_limit_every_allowed_cpu_counts(tmp_path):
    paths = tree(tmp_path, "0::/\n")  # no cgroup mounted, no topology to read
    choice = resolve_threads(environ={}, paths=paths, cpus=FOUR)
    assert (choice.count, choice.source) == (4, AFFINITY)
    assert choice.describe() == "threads: 4 (affinity: 4 CPUs)"
    assert resolve_threads(environ={}, paths=paths, cpus={3}).count == 1  # taskset -c 3


def test_smt_siblings_count_once(tmp_path):
    paths = tree(tmp_path, "0::/\n")
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        write(paths.sys_cpu / f"cpu{cpu}/topology/thread_siblings_list", siblings + "\n")
    choice = resolve_threads(environ={}, paths=paths, cpus=FOUR)
    assert (choice.count, choice.source) == (2, AFFINITY)
    assert choice.reason == "affinity: 4 CPUs, 2 physical cores"
    # Allowed one sibling of each core: two cores, no sharing.
    assert resolve_threads(environ={}, paths=paths, cpus={0, 1}).count == 2
    assert resolve_threads(environ={}, paths=paths, cpus={0, 2}).count == 1


def test_cgroup_v2_cpu_max_caps_the_count(tmp_path):
    mount = tmp_path / "cgroup2"
    paths = tree(tmp_path, "0::/user.slice/app.scope\n", mountinfo_v2(mount))
    write(mount / "user.slice/app.scope/cpu.max", "150000 100000\n")  # 1.5 CPUs: rounded down
    choice = resolve_threads(environ={}, paths=paths, cpus=FOUR)
    assert (choice.count, choice.source) == (1, CGROUP_V2)
    assert choice.describe() == "threads: 1 (cgroup cpu.max 150000/100000 of 4 CPUs)"


def test_cgroup_v2_max_is_no_limit_and_a_parents_limit_binds(tmp_path):
    mount = tmp_path / "cgroup2"
    paths = tree(tmp_path, "0::/kubepods/pod1/ctr\n", mountinfo_v2(mount))
    write(mount / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert resolve_threads(environ={}, paths=paths, cpus=FOUR).source == AFFINITY
    write(mount / "kubepods/pod1/cpu.max", "200000 100000\n")  # the pod's limit
    write(mount / "kubepods/cpu.max", "300000 100000\n")
    choice = resolve_threads(environ={}, paths=paths, cpus=FOUR)
    assert (choice.count, choice.source) == (2, CGROUP_V2)
    # A quota under one CPU still leaves one thread.
    write(mount / "kubepods/pod1/ctr/cpu.max", "50000 100000\n")
    assert resolve_threads(environ={}, paths=paths, cpus=FOUR).count == 1


def test_a_quota_above_the_cores_leaves_the_cores(tmp_path):
    mount = tmp_path / "cgroup2"
    paths = tree(tmp_path, "0::/\n", mountinfo_v2(mount))
    write(mount / "cpu.max", "800000 100000\n")
    assert resolve_threads(environ={}, paths=paths, cpus=FOUR).source == AFFINITY


def test_cgroup_v1_cfs_quota(tmp_path):
    """Docker on cgroup v1 without a cgroup namespace: the container's own directory is bind
    mounted, so the path in /proc/self/cgroup is the mount's root."""
    mount = tmp_path / "cgroup" / "cpu,cpuacct"
    paths = tree(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
        mountinfo_v1("/docker/abc", mount),
    )
    write(mount / "cpu.cfs_quota_us", "-1\n")
    write(mount / "cpu.cfs_period_us", "100000\n")
    assert resolve_threads(environ={}, paths=paths, cpus=FOUR).source == AFFINITY
    write(mount / "cpu.cfs_quota_us", "250000\n")
    choice = resolve_threads(environ={}, paths=paths, cpus=FOUR)
    assert (choice.count, choice.source) == (2, CGROUP_V1)
    assert choice.reason == "cgroup cpu.cfs_quota_us 250000/100000 of 4 CPUs"


def test_without_mountinfo_the_usual_mount_points_are_read(tmp_path):
    paths = tree(tmp_path, "4:cpu,cpuacct:/job\n")  # empty mountinfo
    write(paths.cgroup_root / "cpu,cpuacct/job/cpu.cfs_quota_us", "100000\n")
    write(paths.cgroup_root / "cpu,cpuacct/job/cpu.cfs_period_us", "100000\n")
    assert resolve_threads(environ={}, paths=paths, cpus=FOUR).source == CGROUP_V1
    v2 = tree(tmp_path / "v2", "0::/job\n")
    write(v2.cgroup_root / "job/cpu.max", "100000 100000\n")
    assert resolve_threads(environ={}, paths=v2, cpus=FOUR).source == CGROUP_V2


def test_the_flag_wins_then_omp_num_threads_then_the_limits(tmp_path):
    mount = tmp_path / "cgroup2"
    paths = tree(tmp_path, "0::/\n", mountinfo_v2(mount))
    write(mount / "cpu.max", "100000 100000\n")
    omp = {"OMP_NUM_THREADS": "3"}
    flag = resolve_threads(2, environ=omp, paths=paths, cpus=FOUR)
    assert (flag.count, flag.source, flag.automatic) == (2, FLAG, False)
    env = resolve_threads(environ=omp, paths=paths, cpus=FOUR)
    assert (env.count, env.source, env.automatic) == (3, OMP, False)
    assert env.describe() == "threads: 3 (OMP_NUM_THREADS=3)"
    assert resolve_threads(environ={"OMP_NUM_THREADS": "4,2"}, paths=paths, cpus=FOUR).count == 4
    assert resolve_threads(environ={"OMP_NUM_THREADS": " "}, paths=paths, cpus=FOUR).count == 1
    # More than the CPUs allowed is the user's to choose, and said.
    assert resolve_threads(8, paths=paths, cpus=FOUR).reason == (
        "--threads, more than the 4 CPUs allowed"
    )


@pytest.mark.parametrize("text", ["0", "-2", "1.5", "two", ""])
def test_bad_counts_are_refused(text, tmp_path):
    with pytest.raises(
        ValueError, match=f"--threads must be a whole number of at least 1, not {text!r}"
    ):
        parse_thread_count(text)
    if text:  # an empty OMP_NUM_THREADS is unset
        with pytest.raises(ValueError, match=f"OMP_NUM_THREADS must be .* not {text!r}"):
            resolve_threads(environ={"OMP_NUM_THREADS": text}, paths=tree(tmp_path, ""), cpus=FOUR)


def test_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_generate_limited_to_one_cpu_picks_one_thread_and_says_so():
    """`taskset -c 0 jitney generate`: the process may use one CPU, so one thread, logged."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "JITNEY_THREADS")}
    argv = ["generate", "--model", "tiny-random", "--max-tokens", "2", "--kv-cache-memory", "16MiB"]
    result = subprocess.run(
        [sys.executable, "-m", "jitney.cli", *argv, "hi"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "threads: 1 (affinity: 1 CPU)" in result.stderr


# Runs in the cgroup: what the real kernel files give, and what torch then uses.
IN_CGROUP = """
from engine.threads import apply_threads, resolve_threads
import torch
choice = resolve_threads()
apply_threads(choice)
print(choice.count, torch.get_num_threads(), choice.source, sep="|")
"""


def test_a_process_in_a_cgroup_with_one_cpu_of_quota_takes_one_thread():
    """A real cgroup (v1's cpu controller, where this machine lets the test make one) with a
    quota of one CPU: its process takes one thread by that rule."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: a quota of one changes nothing")
    cpu = Path("/sys/fs/cgroup/cpu")
    group = cpu / f"jitney-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError:
        pytest.skip("no writable cgroup v1 cpu hierarchy here")
    try:
        (group / "cpu.cfs_quota_us").write_text("100000")
        (group / "cpu.cfs_period_us").write_text("100000")
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
        result = subprocess.run(
            [sys.executable, "-c", IN_CGROUP],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "PYTHONPATH": str(REPO)},
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().split("|") == ["1", "1", CGROUP_V1]
    finally:
        group.rmdir()
