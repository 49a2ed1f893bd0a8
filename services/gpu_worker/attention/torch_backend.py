"""Paged attention in plain torch: the reference backend (and the CPU serving path).

Per step (build_metadata), requests are split into two groups, decodes (1 query token) and the rest, so a
long prompt chunk does not pad every decode to its length. For each group it builds, once:

    q_index   [g, max_q]          flat token index of each padded query (padding -> 0)
    q_valid   [g, max_q]          which padded queries are real
    tables    [g, nb]             block table rows, nb = blocks of the longest context (padding -> block 0)
    mask      [g, 1, max_q, nb * block_size]  attend iff key j < seq_len and j <= (seq_len - query_len) + i

Per layer (forward): write the new K/V by slot, gather each group's K and V by whole blocks (one index op,
block-sized contiguous copies) into a padded [2, g, nb * block_size, Hk, D] tensor, and run one
scaled_dot_product_attention per group (GQA via enable_gqa).
No per-request Python loop runs inside a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker.attention.backend import AttentionBackend, write_kv
from services.gpu_worker.attention.metadata import CommonAttentionMetadata


@dataclass
class _Group:
    q_index: torch.Tensor     # [g, max_q] int64
    q_valid: torch.Tensor     # [g, max_q] bool
    out_index: torch.Tensor   # [n] int64: flat token index of each valid query, row-major (= q_index[q_valid])
    tables: torch.Tensor      # [g, nb] int64 block ids
    flat_tables: torch.Tensor  # [g * nb] int64: tables flattened, for one index_select per K and V
    mask: torch.Tensor        # [g, 1, max_q, nb * block_size] bool, True = attend


@dataclass
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    groups: list[_Group]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        is_decode = common.query_lens_cpu == 1
        groups = []
        for selected in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode)):
            if len(selected):
                groups.append(_build_group(common, torch.from_numpy(selected).to(common.seq_lens.device)))
        return TorchAttentionMetadata(common, groups)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.common.slot_mapping)
        out = torch.empty_like(q)                                         # [T, H, D]
        for g in metadata.groups:
            out[g.out_index] = self._attend(q, kv_cache, g)
        return out

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        # index_select on the contiguous [blocks, ...] K and V views copies whole blocks; advanced indexing on dim 1
        # of the [2, blocks, ...] cache was ~1.8x slower on CPU (benchmarks/torch_decode_attention.py).
        n = g.tables.shape[0]
        k, v = (kv_cache[i].index_select(0, g.flat_tables).view(n, -1, self.num_kv_heads, self.head_dim)
                .transpose(1, 2).to(q.dtype) for i in (0, 1))  # [g, Hk, nb * bs, D] each
        qg = q[g.q_index].transpose(1, 2)                      # [g, H, max_q, D]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2)[g.q_valid]                    # [n, H, D]


def _build_group(common: CommonAttentionMetadata, idx: torch.Tensor) -> _Group:
    """idx [g] int64: the requests (batch rows) in this group."""
    device = common.seq_lens.device
    q_lens = common.query_lens[idx].long()                        # [g]
    s_lens = common.seq_lens[idx].long()                          # [g]
    starts = common.query_start_loc[idx].long()                   # [g]
    max_q = int(common.query_lens_cpu[idx.cpu().numpy()].max())
    num_blocks = -(-int(common.seq_lens_cpu[idx.cpu().numpy()].max()) // common.block_size)
    max_ctx = num_blocks * common.block_size
    i = torch.arange(max_q, device=device)                        # [max_q]
    j = torch.arange(max_ctx, device=device)                      # [max_ctx]
    q_valid = i[None, :] < q_lens[:, None]                        # [g, max_q]
    q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0)
    tables = common.block_tables[idx, :num_blocks].long()         # [g, nb]
    ctx_start = (s_lens - q_lens)[:, None, None]                  # [g, 1, 1]
    mask = (j[None, None, :] <= ctx_start + i[None, :, None]) & (j[None, None, :] < s_lens[:, None, None])
    return _Group(q_index=q_index, q_valid=q_valid, out_index=q_index[q_valid], tables=tables,
                  flat_tables=tables.reshape(-1), mask=mask.unsqueeze(1))
