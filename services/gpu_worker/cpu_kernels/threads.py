"""How many threads the worker computes with on the CPU, and how its OpenMP threads wait between kernels.

    quiet_openmp_waits()      # before torch (and its libgomp) loads: idle OpenMP threads stop spinning soon
    n = granted_cpus()        # what --num-threads defaults to: affinity mask and cgroup quota, the smaller

OpenMP threads that finish a kernel spin on the CPU for the next one (libgomp: ~300k spins by default, well past
a millisecond). Alone on a machine that saves a wake-up; beside another busy process the spinning threads take the
cores the working thread needs, and a step slowed ~10x. GOMP_SPINCOUNT bounds the spin (then the thread sleeps);
an operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is.

os.cpu_count() counts the host's CPUs, not the ones a container may use: a pod limited to 2 CPUs on a 64-core node
would start 64 threads, and the kernels' barriers then wait on threads the quota keeps off the CPU. The cgroup v2
cpu.max quota (the smallest along the cgroup's path; v1's cfs quota where v2 is absent), rounded down, and the
affinity mask (taskset, cpusets) both bound the default.
"""

from __future__ import annotations

import math
import os
import pathlib

SPIN_COUNT = "10000"     # spins before an idle OpenMP thread sleeps: a few microseconds, enough between kernels
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


def quiet_openmp_waits(environ=os.environ) -> None:
    """Bound OpenMP's idle spin unless the operator chose a wait policy. Must run before libgomp loads (it reads
    the environment once, when torch or the kernels' library is first loaded)."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def _quota(text: str) -> float | None:
    """CPUs a cpu.max line ("200000 100000", "max 100000") grants; None when unlimited or unreadable."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_cpu_quota(root: pathlib.Path = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """CPUs this process's cgroup may use (the tightest cpu.max from its own cgroup up to the root), or None.
    `self_cgroup` is /proc/self/cgroup's text (read when None); `root` where the hierarchy is mounted."""
    text = self_cgroup if self_cgroup is not None else _read(pathlib.Path("/proc/self/cgroup")) or ""
    lines = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    unified = next((path for hid, _, path in lines if hid == "0"), None)
    if unified is not None and (root / "cgroup.controllers").exists():
        limits = []
        folder = root / unified.strip().lstrip("/")
        while True:
            limit = _quota(_read(folder / "cpu.max") or "")
            if limit is not None:
                limits.append(limit)
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
        return min(limits) if limits else None
    v1 = next((path for _, controllers, path in lines if "cpu" in controllers.split(",")), None)
    if v1 is None:
        return None
    for folder in (root / "cpu" / v1.strip().lstrip("/"), root / "cpu", root / "cpu,cpuacct"):
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return _quota(f"{quota.strip()} {period.strip()}")
    return None


def granted_cpus(quota: float | None = None, affinity: int | None = None) -> int:
    """Threads to compute with: the CPUs in this process's affinity mask, capped by the cgroup quota (rounded
    down, at least 1). The arguments stand in for what is read from the system (tests)."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if quota is None:
        quota = cgroup_cpu_quota()
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.floor(quota + 1e-9)))
