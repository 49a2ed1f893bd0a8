"""CPU thread settings (cpu_kernels/threads.py): the cgroup quota and affinity mask bound the default thread count,
and OpenMP's idle spin is bounded unless the operator chose a policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from steploop.gpu_worker.cpu_kernels import threads


def cgroup_v2(tmp_path, limits: dict[str, str]):
    """A fake cgroup v2 mount: each folder (relative to the root) with its cpu.max line."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    for folder, line in limits.items():
        path = tmp_path / folder
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.max").write_text(line + "\n")
    return tmp_path


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    root = cgroup_v2(tmp_path, {"kubepods": "400000 100000", "kubepods/pod1": "max 100000",
                                "kubepods/pod1/ctr": "150000 100000"})
    assert threads.cgroup_cpu_quota(root, "0::/kubepods/pod1/ctr\n") == 1.5
    assert threads.cgroup_cpu_quota(root, "0::/kubepods/pod1\n") == 4.0      # its parent's limit applies
    assert threads.cgroup_cpu_quota(root, "0::/elsewhere\n") is None          # no cpu.max anywhere: unlimited


def test_cgroup_v2_unlimited_or_malformed(tmp_path):
    root = cgroup_v2(tmp_path, {"a": "max 100000", "b": "garbage", "c": "-1 100000", "": "200000 100000"})
    assert threads.cgroup_cpu_quota(root, "0::/a\n") == 2.0          # a container's own root cpu.max counts
    assert threads.cgroup_cpu_quota(root, "0::/b\n") == 2.0
    assert threads.cgroup_cpu_quota(root, "0::/c\n") == 2.0
    (root / "cpu.max").unlink()
    assert threads.cgroup_cpu_quota(root, "0::/a\n") is None


def test_cgroup_v1_cfs_quota(tmp_path):
    folder = tmp_path / "cpu" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("250000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    self_cgroup = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
    assert threads.cgroup_cpu_quota(tmp_path, self_cgroup) == 2.5
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpu_quota(tmp_path, self_cgroup) is None


@pytest.mark.parametrize("quota, affinity, expected", [(None, 8, 8), (1.5, 8, 1), (2.0, 8, 2), (16.0, 4, 4),
                                                      (0.5, 8, 1), (3.9999999999, 64, 4)])
def test_granted_cpus_takes_the_smaller_rounded_down(quota, affinity, expected):
    assert threads.granted_cpus(quota, affinity) == expected


def test_granted_cpus_reads_this_process():
    granted = threads.granted_cpus()
    assert 1 <= granted <= len(os.sched_getaffinity(0))


def test_openmp_spin_is_bounded_unless_chosen():
    env = {}
    threads.quiet_openmp_waits(env)
    assert env == {"GOMP_SPINCOUNT": threads.SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "infinite"}):
        env = dict(chosen)
        threads.quiet_openmp_waits(env)
        assert env == chosen


def test_worker_processes_get_the_bound_before_torch_loads():
    """Importing the worker package sets it before any torch import, so libgomp starts with it."""
    code = ("import sys, os; import steploop.gpu_worker.server; "
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.split() == [threads.SPIN_COUNT, "True"]
