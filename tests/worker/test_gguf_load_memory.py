"""The GGUF loader's temporaries stay a row chunk's, whatever the tensor's size: a vocabulary-sized output or
embedding table (128256 x 4096 in a Llama-3.1-8B) decoded whole took several bytes a weight at once (~3 GB over the
weights at the load's peak). tracemalloc sees numpy's allocations, where the decode and layout work happens."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from steploop.gpu_worker.gguf import weights
from steploop.gpu_worker.gguf.block_embedding import BlockEmbedding
from tests.worker.gguf_files import quantize

ROWS, K = 4096, 2048                  # 8.4 M weights: 16 chunks of 512 K
CHUNK = 1 << 19


def _raw(qtype: T) -> np.ndarray:
    return quantize(np.broadcast_to(np.float32(0), (ROWS, K)), qtype, seed=3)


def _numpy_peak(build) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = build()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q4_K], ids=lambda t: t.name)
def test_packing_a_large_tensor_keeps_its_temporaries_to_a_chunk(qtype, monkeypatch):
    monkeypatch.setattr(weights, "CHUNK_WEIGHTS", CHUNK)
    raw = _raw(qtype)
    tensor = SimpleNamespace(data=raw, name="output.weight", tensor_type=qtype, n_bytes=raw.nbytes,
                             shape=np.array([K, ROWS]))
    part = weights._Part(tensor, "lm_head.weight", None, None)
    packed, peak = _numpy_peak(lambda: weights._packed_weight([part], ROWS, K, "llama", None, weights.LoadStats()))
    assert packed.out_features == ROWS
    assert peak < ROWS * K, peak / 2**20         # < 1 byte a weight (~7 bytes a chunk's); whole: 5.7 bytes a weight


def test_a_block_embedding_keeps_its_temporaries_to_a_chunk():
    raw = _raw(T.Q4_K)
    table, peak = _numpy_peak(lambda: BlockEmbedding.from_blocks(raw, T.Q4_K, K, rows_per_chunk=CHUNK // K))
    assert table(torch.tensor([[0, ROWS - 1]])).shape == (1, 2, K)
    assert peak < ROWS * K, peak / 2**20


def test_the_pages_dropped_are_those_under_the_rows_read(tmp_path):
    """FilePages.drop_view: a rank's cut of the mapped rows (whole rows, or a column range of them) drops the file
    bytes it spans; a copy (llama's unpermuted q/k rows) drops nothing."""
    from steploop.gpu_worker.gguf.file_pages import FilePages
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(1 << 16))
    data = np.memmap(path, mode="r")
    pages = FilePages(SimpleNamespace(data=data))
    dropped = []
    pages.drop = lambda start, end: dropped.append((start, end))
    rows = data[1024:1024 + 64 * 100].reshape(100, 64)               # a tensor of 100 rows of 64 bytes at 1024
    pages.drop_view(rows[10:20])
    pages.drop_view(rows[10:20, 32:48])
    pages.drop_view(rows[10:20].copy())
    assert dropped == [(1024 + 640, 1024 + 1280), (1024 + 640 + 32, 1024 + 19 * 64 + 48)]
