"""CUDA graphs for decode-only steps: capture the whole forward once per batch size, then replay.

A step qualifies when every scheduled request feeds exactly one token and samples from it (no prompt chunk,
no draft). Its n requests are padded up to the smallest captured size B >= n:

    row:           0 .. n-1 (real)                    n .. B-1 (padding)
    input_ids      the step's tokens                  whatever was there (never read back)
    positions      the step's positions               whatever was there (< max_model_len)
    slot_mapping   the step's slots                   -1: the cache-write kernel skips them
    seq_lens       the step's context lengths         0: attention reads no key, writes zeros
    block_tables   the step's rows (width <= static)  whatever was there (never read: seq_len 0)
    query_start_loc, logits_indices, tiles: 0..B, fixed at capture

All of it lives in static buffers whose addresses the graphs captured; a replay copies the step's values in,
replays, and returns the first n rows of the captured output. The attention plan (tiles, split count) is built
once at capture with the longest context the model allows, so it is valid for any step of that size.

Only the padding (`pad_decode_step`) and the eager path (`capture=False`, used by CPU tests) run without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def pick_size(n: int, sizes: tuple[int, ...] = CAPTURE_SIZES) -> int | None:
    """Smallest captured batch size >= n, or None (run eagerly)."""
    return next((s for s in sorted(sizes) if s >= n), None) if n > 0 else None


def is_decode_only(common: CommonAttentionMetadata, num_logits: int) -> bool:
    return common.num_reqs > 0 and common.max_query_len == 1 and num_logits == common.num_reqs


@dataclass
class DecodeBuffers:
    """Static inputs of the largest size; a graph of size B uses the first B rows."""
    input_ids: torch.Tensor       # [B_max] int64
    positions: torch.Tensor       # [B_max] int64
    slot_mapping: torch.Tensor    # [B_max] int64
    seq_lens: torch.Tensor        # [B_max] int32
    query_start_loc: torch.Tensor  # [B_max + 1] int32 = 0..B_max
    block_tables: torch.Tensor    # [B_max, max_blocks] int32
    logits_indices: torch.Tensor  # [B_max] int64 = 0..B_max-1

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def z(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(input_ids=z(max_size, dtype=torch.int64), positions=z(max_size, dtype=torch.int64),
                   slot_mapping=torch.full((max_size,), -1, dtype=torch.int64, device=device),
                   seq_lens=z(max_size, dtype=torch.int32),
                   query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
                   block_tables=z(max_size, max_blocks, dtype=torch.int32),
                   logits_indices=torch.arange(max_size, dtype=torch.int64, device=device))

    def common(self, size: int, block_size: int, seq_lens_cpu: np.ndarray) -> CommonAttentionMetadata:
        """Metadata over the first `size` rows (views: the graph sees later copies into them)."""
        return CommonAttentionMetadata(
            num_reqs=size, num_tokens=size, block_size=block_size, max_query_len=1,
            max_seq_len=int(seq_lens_cpu.max(initial=0)), query_start_loc=self.query_start_loc[:size + 1],
            query_lens=self.query_start_loc[1:size + 1] - self.query_start_loc[:size],
            seq_lens=self.seq_lens[:size], slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size], query_lens_cpu=np.ones(size, np.int32),
            seq_lens_cpu=seq_lens_cpu)


def pad_decode_step(buffers: DecodeBuffers, input_ids: torch.Tensor, positions: torch.Tensor,
                    common: CommonAttentionMetadata, size: int) -> np.ndarray:
    """Copy one decode step of n rows into the static buffers and pad rows n..size-1; returns seq_lens_cpu
    [size] of the padded batch."""
    n, width = common.num_reqs, common.block_tables.shape[1]
    buffers.input_ids[:n].copy_(input_ids, non_blocking=True)
    buffers.positions[:n].copy_(positions, non_blocking=True)
    buffers.slot_mapping[:n].copy_(common.slot_mapping, non_blocking=True)
    buffers.slot_mapping[n:size].fill_(-1)
    buffers.seq_lens[:n].copy_(common.seq_lens, non_blocking=True)
    buffers.seq_lens[n:size].fill_(0)
    buffers.block_tables[:n, :width].copy_(common.block_tables, non_blocking=True)
    return np.concatenate([common.seq_lens_cpu.astype(np.int32), np.zeros(size - n, np.int32)])


class DecodeGraphRunner:
    """capture=True (CUDA): record one graph per size, replay them. capture=False: the same padding and static
    buffers, run eagerly (how CPU tests check the padding; no speed-up)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
                 sizes: tuple[int, ...] = CAPTURE_SIZES, capture: bool = True):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_model_len, self.sizes, self.capture = max_model_len, tuple(sorted(sizes)), capture
        self.device = kv_caches[0].device
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], -(-max_model_len // block_size), self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._metadata: dict[int, object] = {}   # captured per-size attention metadata, kept alive

    def capture_all(self) -> None:
        """Warm up (compiles the kernels) and capture, largest size first so smaller graphs reuse its pool."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            md = self._build_metadata(size, np.zeros(size, np.int32), hint=self.max_model_len)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(size, md)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size, md)
            self.graphs[size], self._metadata[size] = (graph, out), md
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", list(self.sizes))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata,
            num_logits: int) -> torch.Tensor | None:
        """hidden [n, hidden] for a decode-only step, or None when this step must run eagerly."""
        size = pick_size(common.num_reqs, self.sizes)
        if size is None or not is_decode_only(common, num_logits) \
                or common.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            return None
        seq_lens_cpu = pad_decode_step(self.buffers, input_ids, positions, common, size)
        if self.capture:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self._forward(size, self._build_metadata(size, seq_lens_cpu, hint=None))
        return out[:common.num_reqs]

    def _build_metadata(self, size: int, seq_lens_cpu: np.ndarray, hint: int | None):
        common = self.buffers.common(size, self.block_size, seq_lens_cpu)
        return self.model.backend.build_metadata(common, max_seq_len_hint=hint)

    def _forward(self, size: int, md) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:size], b.positions[:size], self.kv_caches, md, b.logits_indices[:size])

