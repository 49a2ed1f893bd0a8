"""host_memory: the CPU KV cache in transparent huge pages, zeroed, writable, and plain torch when switched off."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch

from steploop.common import envs
from steploop.gpu_worker import host_memory, kv_cache

THP_MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vma_field(ptr: int, field: str) -> str | None:
    """`field` of the /proc/self/smaps entry whose range holds address ptr."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def test_zeros_is_a_zeroed_writable_tensor():
    t = host_memory.zeros((3, 1024, 1024), torch.float32)       # 12 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    t[1, 2, 3] = 5.0
    assert t.sum().item() == 5.0
    small = host_memory.zeros((4, 4), torch.float16)             # under one huge page: plain torch
    assert small.dtype == torch.float16 and not small.any()


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this host has no transparent huge pages")
def test_zeros_asks_for_huge_pages():
    t = host_memory.zeros((4, 1024, 1024), torch.float32)
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert "hg" in _vma_field(t.data_ptr(), "VmFlags").split()
    assert _vma_field(t.data_ptr(), "THPeligible") == "1"


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this host has no transparent huge pages")
def test_zeros_faults_every_page_in_at_once():
    """Resident before anything touches it: left to the first write, the kernel zeroed each 2 MiB page inside a
    decode step, and a pool past the memory left would fail while serving instead of at start."""
    t = host_memory.zeros((8, 1024, 1024), torch.float32)       # 32 MiB, read from smaps before any access
    rss_kib = int(_vma_field(t.data_ptr(), "Rss").split()[0])
    assert rss_kib * 1024 >= t.numel() * t.element_size()


def test_switched_off_gives_plain_torch(monkeypatch):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.kernel_plan import resolve_kernel_plan
    from tests.worker.test_cpu_paged_attention import TINY
    monkeypatch.setenv(envs.CPU_HUGEPAGES, "0")
    plan = resolve_kernel_plan(WorkerConfig(device="cpu"), torch.device("cpu"), torch.float32, TINY)
    assert not plan.hugepages and dict(plan.why_off)["huge pages"] == "STEPLOOP_CPU_HUGEPAGES=0"
    def no_mapping(*args, **kwargs):
        raise AssertionError("host_memory mapped its own region with huge pages switched off")

    monkeypatch.setattr(host_memory.mmap, "mmap", no_mapping)
    t = host_memory.zeros((4, 1024, 1024), torch.float32, plan.hugepages)
    assert not t.any() and t.shape == (4, 1024, 1024)
    # The path is what is checked, not the VMA's flags: a plain allocation lands wherever the process's allocator
    # puts it, and after the whole worker suite (2026-12-03) one landed in a VMA already carrying "hg".


def test_cpu_kv_cache_comes_from_host_memory(monkeypatch):
    calls = []
    real = host_memory.zeros
    monkeypatch.setattr(host_memory, "zeros",
                        lambda shape, dtype, huge: calls.append((shape, huge)) or real(shape, dtype, huge))
    cfg = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
    caches = kv_cache.allocate_kv_caches(cfg, 8, 16, torch.float32, torch.device("cpu"), hugepages=True)
    assert len(caches) == 2 and calls == [((2, 8, 16, 2, 16), True)] * 2
    assert all(c.shape == (2, 8, 16, 2, 16) and not c.any() for c in caches)
