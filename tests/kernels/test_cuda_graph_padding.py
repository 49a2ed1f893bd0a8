"""The CPU-testable half of the CUDA-graph path: bucket choice, padding into static buffers, backend choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steploop.gpu_worker.attention.metadata import build_common_metadata
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cuda_graphs import DecodeBuffers, is_decode_only, pad_decode_step, pick_size


@pytest.mark.parametrize("n,size", [(1, 1), (2, 2), (3, 4), (33, 64), (256, 256), (257, None), (0, None)])
def test_pick_size(n, size):
    assert pick_size(n) == size


def test_pad_decode_step():
    buffers = DecodeBuffers.allocate(8, max_blocks=4, device=torch.device("cpu"))
    buffers.seq_lens.fill_(99)
    tables = np.array([[3, 4], [5, 0], [6, 7]], np.int32)
    common = build_common_metadata(np.ones(3, np.int32), np.array([20, 2, 17], np.int32), tables,
                                   np.array([67, 81, 96], np.int64), 16, torch.device("cpu"))
    seq_cpu = pad_decode_step(buffers, torch.tensor([11, 12, 13]), torch.tensor([19, 1, 16]), common, size=4)
    assert seq_cpu.tolist() == [20, 2, 17, 0]
    assert buffers.seq_lens[:4].tolist() == [20, 2, 17, 0]
    assert buffers.slot_mapping[:4].tolist() == [67, 81, 96, -1]
    assert buffers.input_ids[:3].tolist() == [11, 12, 13] and buffers.positions[:3].tolist() == [19, 1, 16]
    assert buffers.block_tables[:3, :2].tolist() == tables.tolist()
    padded = buffers.common(4, 16, seq_cpu)
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4] and padded.query_lens.tolist() == [1, 1, 1, 1]
    assert is_decode_only(common, 3) and not is_decode_only(common, 4)


@pytest.mark.parametrize("flag,device,want", [("auto", "cpu", "torch"), ("auto", "cuda", "triton"),
                                              ("torch", "cuda", "torch"), ("triton", "cuda", "triton")])
def test_backend_selection(flag, device, want):
    config = WorkerConfig(attention_backend=flag)
    assert config.resolved_attention_backend(device) == want
    assert config.use_cuda_graphs(device) == (want == "triton" and device == "cuda")
    assert not WorkerConfig(attention_backend=flag, cuda_graphs=False).use_cuda_graphs(device)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        WorkerConfig(attention_backend="triton").resolved_attention_backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert WorkerConfig(attention_backend="triton").resolved_attention_backend("cpu") == "triton"
