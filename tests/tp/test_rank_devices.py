"""--device auto on a CUDA host gives each rank of a group its own GPU (rank R on cuda:R, wrapping around on a host
with fewer GPUs): NCCL refuses two ranks of one group on one device. Explicit --device values are kept."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.config import WorkerConfig


@pytest.mark.parametrize("rank, gpus, want", [(0, 4, "cuda:0"), (3, 4, "cuda:3"), (5, 4, "cuda:1"), (1, 1, "cuda:0")])
def test_auto_puts_each_rank_on_its_own_gpu(monkeypatch, rank, gpus, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    config = WorkerConfig(tensor_parallel_size=8, rank=rank)
    assert config.resolved_device() == want


def test_explicit_devices_and_a_host_without_cuda(monkeypatch):
    assert WorkerConfig(device="cuda:2", tensor_parallel_size=2, rank=1).resolved_device() == "cuda:2"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert WorkerConfig(tensor_parallel_size=2, rank=1).resolved_device() == "cpu"
