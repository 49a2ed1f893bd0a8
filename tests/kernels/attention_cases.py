"""Random paged-attention cases: a flat batch of requests with block tables drawn from a shuffled pool."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata, build_common_metadata


@dataclass
class Case:
    q: torch.Tensor                 # [T, H, D]
    k: torch.Tensor                 # [T, Hk, D] the step's new keys
    v: torch.Tensor                 # [T, Hk, D]
    kv_cache: torch.Tensor          # [2, num_blocks, block_size, Hk, D] with the cached context filled in
    common: CommonAttentionMetadata
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor      # [R, max_blocks] int32


def make_case(query_lens: list[int], cached: list[int], *, heads: tuple[int, int] = (4, 2), head_dim: int = 64,
              block_size: int = 16, dtype: torch.dtype = torch.float32, share_prefix_blocks: int = 0,
              device: torch.device | None = None, seed: int = 0) -> Case:
    """share_prefix_blocks = n: every request's first n blocks are request 0's (a prefix-cache hit)."""
    device = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    h, hk = heads
    seq_lens = [c + q for c, q in zip(cached, query_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()     # block 0 stays the null block
    tables = np.zeros((len(query_lens), max(need)), np.int32)
    for r, n in enumerate(need):
        shared = min(share_prefix_blocks, n) if r else 0
        tables[r, :shared] = tables[0, :shared]
        tables[r, shared:n] = [pool.pop() for _ in range(n - shared)]
    kv_cache = torch.randn((2, num_blocks, block_size, hk, head_dim), generator=gen).to(dtype)
    t = sum(query_lens)
    q, k, v = (torch.randn((t, n, head_dim), generator=gen).to(dtype) for n in (h, hk, hk))
    positions = np.concatenate([np.arange(c, s) for c, s in zip(cached, seq_lens)])
    req = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = tables[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    common = build_common_metadata(np.array(query_lens, np.int32), np.array(seq_lens, np.int32), tables, slots,
                                   block_size, device)
    return Case(q.to(device), k.to(device), v.to(device), kv_cache.to(device), common, list(query_lens),
                seq_lens, torch.from_numpy(tables).to(device))
