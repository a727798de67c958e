"""How many compute threads the process runs, decided once at start from what it may use.

The kernels and torch's own CPU ops share torch's intra-op pool (at::parallel_for), so one number
sizes both. In order, the first that applies wins:
1. `--threads N` (or JITNEY_THREADS), the operator's explicit choice;
2. OMP_NUM_THREADS, which torch itself honours, set by the user or a deployment;
3. the automatic rule: the physical cores among the CPUs the process may run on
   (`sched_getaffinity`: taskset, a cpuset), capped by the cgroup CPU quota (v2 `cpu.max`,
   v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, the tightest along the cgroup's ancestors),
   rounded down, at least 1.

Threads beyond the CPUs the process gets wait for each other at every parallel region's barrier:
in a container limited to one CPU, the host's core count is the slowest choice there is. SMT
siblings are not counted (`count_cores`): decode is bound by memory, and a sibling shares its
core's caches and load units; torch (through MKL) and llama.cpp count physical cores alike.
That rule is one function, to change once it is measured on an SMT machine.

Nothing here imports torch: the commands decide before torch loads and refuse a bad value in a
moment; `apply_threads` sets the number once torch is wanted. The paths are parameters
(`SystemPaths`), so the tests read files of their own.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

FLAG, OMP, AFFINITY = "--threads", "OMP_NUM_THREADS", "affinity"
CGROUP_V2, CGROUP_V1 = "cgroup cpu.max", "cgroup cpu.cfs_quota_us"
MAX_CGROUP_DEPTH = 64  # a guard: no real hierarchy is this deep


@dataclass(frozen=True, slots=True)
class SystemPaths:
    """Where the process's CPU limits are read (the tests point these at a temp tree)."""

    proc_self: Path = Path("/proc/self")  # its `cgroup` and `mountinfo`
    sys_cpu: Path = Path("/sys/devices/system/cpu")  # cpuN/topology/thread_siblings_list
    cgroup_root: Path = Path("/sys/fs/cgroup")  # where cgroups are mounted, when mountinfo fails


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """The thread count and where it came from: `source` is FLAG, OMP, AFFINITY, CGROUP_V2 or
    CGROUP_V1; `reason` says it for a log line."""

    count: int
    source: str
    reason: str

    def describe(self) -> str:
        return f"threads: {self.count} ({self.reason})"

    @property
    def automatic(self) -> bool:
        """Decided by the rule, not given by the user (FLAG, OMP)."""
        return self.source not in (FLAG, OMP)


@dataclass(frozen=True, slots=True)
class CpuQuota:
    """A cgroup's CPU bandwidth limit: `quota_us` of CPU time every `period_us`."""

    quota_us: int
    period_us: int
    source: str  # CGROUP_V2 or CGROUP_V1
    directory: Path

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us


def parse_thread_count(text: str, name: str = FLAG) -> int:
    """A thread count as given by the user: a whole number of at least 1."""
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {text!r}")
    return value


def resolve_threads(
    flag: int | None = None,
    environ: Mapping[str, str] | None = None,
    paths: SystemPaths = SystemPaths(),
    cpus: set[int] | None = None,
) -> ThreadChoice:
    """The process's thread count: --threads, else OMP_NUM_THREADS, else the automatic rule.
    `cpus` stands for the affinity mask (default: the process's own). Raises ValueError for an
    OMP_NUM_THREADS that is not a positive whole number."""
    allowed = allowed_cpus() if cpus is None else cpus
    if flag is not None:
        if flag < 1:
            raise ValueError(f"{FLAG} must be a whole number of at least 1, not {flag}")
        return ThreadChoice(flag, FLAG, FLAG + _beyond(flag, allowed))
    environ = os.environ if environ is None else environ
    omp = environ.get(OMP, "").strip()
    if omp:
        # OpenMP's list form ("4,2") sizes nested levels: the first is the outer pool.
        count = parse_thread_count(omp.split(",")[0], OMP)
        return ThreadChoice(count, OMP, f"{OMP}={omp}" + _beyond(count, allowed))
    return automatic_threads(allowed, paths)


def automatic_threads(cpus: set[int], paths: SystemPaths = SystemPaths()) -> ThreadChoice:
    """The physical cores among `cpus`, capped by the cgroup quota (rounded down, at least 1)."""
    cores = count_cores(cpus, paths.sys_cpu)
    quota = cgroup_cpu_quota(paths)
    of = f"of {_cpus(len(cpus))}"
    if quota is not None and math.floor(quota.cpus) < cores:
        count = max(1, math.floor(quota.cpus))
        return ThreadChoice(
            count, quota.source, f"{quota.source} {quota.quota_us}/{quota.period_us} {of}"
        )
    smt = "" if cores == len(cpus) else f", {cores} physical cores"
    return ThreadChoice(cores, AFFINITY, f"{AFFINITY}: {_cpus(len(cpus))}{smt}")


def count_cores(cpus: set[int], sys_cpu: Path) -> int:
    """THE SMT RULE: the CPUs counted as compute threads. Each physical core among `cpus`
    counts once, whatever number of its SMT siblings the process may use (a CPU whose topology
    cannot be read counts as a core of its own). To count siblings, return len(cpus)."""
    cores: set[frozenset[int]] = set()
    for cpu in cpus:
        try:
            text = (sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            siblings = parse_cpu_list(text) & cpus
        except (OSError, ValueError):
            siblings = set()
        cores.add(frozenset(siblings or {cpu}))
    return max(1, len(cores))


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; all of them where there is none)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list, "0-3,8,10-11", as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cgroup_cpu_quota(paths: SystemPaths = SystemPaths()) -> CpuQuota | None:
    """The tightest CPU quota over the process's cgroup and its ancestors, in either cgroup
    version (both are read where a hybrid system mounts both); None when there is none."""
    try:
        memberships = (paths.proc_self / "cgroup").read_text().splitlines()
    except OSError:  # not Linux, or no cgroups
        return None
    mounts = _cgroup_mounts(paths.proc_self / "mountinfo")
    quotas: list[CpuQuota] = []
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, cgroup = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2, the unified hierarchy
            mount = mounts.get("cgroup2") or (Path("/"), paths.cgroup_root)
            quotas += _walk(mount, cgroup, _read_cpu_max)
        elif "cpu" in controllers.split(","):  # v1, the cpu controller's hierarchy
            fallback = (Path("/"), _v1_fallback(paths.cgroup_root))
            quotas += _walk(mounts.get("cpu", fallback), cgroup, _read_cfs_quota)
    return min(quotas, key=lambda q: q.cpus, default=None)


def _cgroup_mounts(mountinfo: Path) -> dict[str, tuple[Path, Path]]:
    """(the mount's root within the hierarchy, its mount point) of the cgroup2 mount and of the
    v1 mount holding the cpu controller, from /proc/self/mountinfo."""
    found: dict[str, tuple[Path, Path]] = {}
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, described = fields.split(), tail.split()
        if len(parts) < 5 or len(described) < 3:
            continue
        mount = (Path(_unescape(parts[3])), Path(_unescape(parts[4])))
        if described[0] == "cgroup2":
            found.setdefault("cgroup2", mount)
        elif described[0] == "cgroup" and "cpu" in described[2].split(","):
            found.setdefault("cpu", mount)
    return found


def _unescape(field: str) -> str:
    """mountinfo writes a space in a path as \\040 (octal), a backslash as \\134."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _v1_fallback(root: Path) -> Path:
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if (root / name).is_dir():
            return root / name
    return root / "cpu"


def _walk(
    mount: tuple[Path, Path], cgroup: str, read: Callable[[Path], CpuQuota | None]
) -> list[CpuQuota]:
    """`read` in the process's cgroup directory and each parent up to the mount point: a
    limit set on a parent (a Kubernetes pod's) binds the cgroup inside it too."""
    root, point = mount
    try:  # /proc/self/cgroup names the path from the hierarchy's root; the mount may start lower
        relative = Path(cgroup).relative_to(root)
    except ValueError:  # outside what is mounted here (another cgroup namespace): the mount
        relative = Path(".")
    directory = point / relative
    quotas = []
    for _ in range(MAX_CGROUP_DEPTH):
        quota = read(directory)
        if quota is not None:
            quotas.append(quota)
        if directory == point or point not in directory.parents:
            break
        directory = directory.parent
    return quotas


def _read_cpu_max(directory: Path) -> CpuQuota | None:
    """v2 `cpu.max`: "<quota> <period>", or "max <period>" for no limit."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return _quota(int(quota), int(period), CGROUP_V2, directory)
    except (OSError, ValueError):
        return None


def _read_cfs_quota(directory: Path) -> CpuQuota | None:
    """v1 `cpu.cfs_quota_us` (-1: no limit) over `cpu.cfs_period_us`."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return _quota(quota, period, CGROUP_V1, directory)
    except (OSError, ValueError):
        return None


def _quota(quota: int, period: int, source: str, directory: Path) -> CpuQuota | None:
    return CpuQuota(quota, period, source, directory) if quota > 0 and period > 0 else None


def _cpus(n: int) -> str:
    return f"{n} CPU" if n == 1 else f"{n} CPUs"


def _beyond(count: int, cpus: set[int]) -> str:
    """A note when an explicit count exceeds the CPUs the process may run on."""
    return f", more than the {_cpus(len(cpus))} allowed" if count > len(cpus) else ""


def apply_threads(choice: ThreadChoice) -> None:
    """Size torch's intra-op pool (the kernels' at::parallel_for, MKL and oneDNN) to the choice;
    threads started later (the worker's engine loop) take the same number. An automatic count
    then follows the CPUs other processes leave free (engine/thread_governor.py)."""
    import torch

    from engine.thread_governor import govern

    torch.set_num_threads(choice.count)
    govern(choice, allowed_cpus())
