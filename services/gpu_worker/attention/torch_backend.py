"""Paged attention in plain torch: the reference backend (and the CPU serving path).

Per step (build_metadata), requests are split into two groups, decodes (1 query token) and the rest, so a
long prompt chunk does not pad every decode to its length. On the CPU in fp32, when the fused C kernel
(cpu_kernels/paged_attention.c; the KernelPlan turns it on, STEPLOOP_CPU_ATTENTION_KERNEL=0 keeps it off)
is on, the first group is instead every request kernel_eligible() names (decodes, draft
verification, and prompt chunks whose query_len x seq_len is small): the kernel reads K/V straight from the paged
cache, one call per layer, no gather and no mask. Long chunks over long contexts keep the path below, whose GEMMs
beat the kernel's loops there.
For each SDPA group it builds, once:

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

from steploop.gpu_worker.attention.backend import AttentionBackend
from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata

KERNEL_MAX_QUERY_LEN = 8        # decodes, draft verification: always the kernel
# Longer chunks too while query_len x seq_len stays under this: measured on 2 cores (9 query / 3 KV heads), the
# kernel beats gather + SDPA on prompt chunks with short contexts (64 new tokens over 192: 0.46 vs 0.57 ms per
# layer) and breaks even near 128 x 384; with long cached contexts SDPA's GEMMs win (256 over 1280: 6.8 vs 10.4 ms).
KERNEL_MAX_CHUNK_WORK = 32768


def kernel_eligible(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """[num_reqs] bool: the requests whose attention the C kernel computes (a property of each request alone, so a
    request takes the same path whatever else is in the batch)."""
    return (query_lens <= KERNEL_MAX_QUERY_LEN) | (query_lens.astype(np.int64) * seq_lens <= KERNEL_MAX_CHUNK_WORK)


@dataclass
class _Group:
    q_index: torch.Tensor     # [g, max_q] int64
    q_valid: torch.Tensor     # [g, max_q] bool
    out_index: torch.Tensor   # [n] int64: flat token index of each valid query, row-major (= q_index[q_valid])
    tables: torch.Tensor      # [g, nb] int64 block ids
    flat_tables: torch.Tensor  # [g * nb] int64: tables flattened, for one index_select per K and V
    mask: torch.Tensor        # [g, 1, max_q, nb * block_size] bool, True = attend


@dataclass
class _KernelGroup:
    """Requests served by the C kernel: its arguments, sliced to these requests once per step."""
    idx: torch.Tensor                # [g] int64 requests (for the SDPA fallback when the dtype is not fp32)
    rows: torch.Tensor | None        # [n] int64 flat token index of each query; None: the whole batch, in order
    block_tables: torch.Tensor       # [g, max_blocks] int32
    query_start_loc: torch.Tensor    # [g + 1] int32, into the group's own n queries
    seq_lens: torch.Tensor           # [g] int32
    num_threads: int
    fallback: _Group | None = None


@dataclass
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    groups: list[_Group | _KernelGroup]

    @property
    def whole_batch_in_kernel(self) -> bool:
        """Every request's attention is the C kernel's, in batch order (what cpu_kernels/decoder.c runs)."""
        return (len(self.groups) == 1 and isinstance(self.groups[0], _KernelGroup) and self.groups[0].rows is None
                and self.common.num_tokens > 0)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, cpu_kernel: bool = False):
        """cpu_kernel: run kernel_eligible() requests in the C kernel on fp32 CPU steps (KernelPlan decides)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.cpu_kernel = None       # the C kernel's entry point, used for fp32 steps on the CPU
        if cpu_kernel:
            from steploop.gpu_worker.cpu_kernels import paged_attention
            if not paged_attention.supports(num_heads, num_kv_heads, head_dim):
                raise ValueError(f"{num_heads} heads / {num_kv_heads} KV heads of size {head_dim} are past the C "
                                 "paged-attention kernel's limits")
            if not paged_attention.available():
                raise RuntimeError("the C paged-attention kernel did not build")
            self.cpu_kernel = paged_attention.paged_attention

    def build_metadata(self, common: CommonAttentionMetadata, max_seq_len_hint: int | None = None,
                       staged=None) -> TorchAttentionMetadata:
        """Plans on the host from this step's own lengths every step, so the hint is not needed (nor staging: the
        CPU path's index tensors are host tensors already)."""
        device = common.seq_lens.device
        if self.cpu_kernel is not None and device.type == "cpu":
            short = kernel_eligible(common.query_lens_cpu, common.seq_lens_cpu)
            kernel, rest = np.flatnonzero(short), np.flatnonzero(~short)
            groups = [_build_kernel_group(common, kernel)] if len(kernel) else []
        else:
            is_decode = common.query_lens_cpu == 1
            groups, rest = [], np.flatnonzero(~is_decode)
            if is_decode.any():
                groups.append(_build_group(common, torch.from_numpy(np.flatnonzero(is_decode)).to(device)))
        if len(rest):
            groups.append(_build_group(common, torch.from_numpy(rest).to(device)))
        return TorchAttentionMetadata(common, groups)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.common.slot_mapping)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, H, D]
        for g in metadata.groups:
            if isinstance(g, _Group):
                out[g.out_index] = self._attend(q, kv_cache, g)
            elif q.dtype == kv_cache.dtype == torch.float32:
                self._attend_kernel(q, kv_cache, g, out)
            else:                                                         # e.g. --dtype bfloat16 on the CPU
                g.fallback = g.fallback or _build_group(metadata.common, g.idx)
                out[g.fallback.out_index] = self._attend(q, kv_cache, g.fallback)
        return out

    def _attend_kernel(self, q: torch.Tensor, kv_cache: torch.Tensor, g: _KernelGroup, out: torch.Tensor) -> None:
        if g.rows is None:
            self.cpu_kernel(out, q.contiguous(), kv_cache, g.block_tables, g.query_start_loc, g.seq_lens, self.scale,
                            g.num_threads)
            return
        o = q.new_empty((len(g.rows), self.num_heads, self.head_dim))
        self.cpu_kernel(o, q[g.rows], kv_cache, g.block_tables, g.query_start_loc, g.seq_lens, self.scale,
                        g.num_threads)
        out[g.rows] = o

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


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter k/v [T, Hk, D] into kv_cache [2, num_blocks, block_size, Hk, D] at slot_mapping [T]."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])   # [2, num_slots, Hk, D]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _build_kernel_group(common: CommonAttentionMetadata, selected: np.ndarray) -> _KernelGroup:
    """selected [g]: the requests (batch rows, ascending) whose queries the C kernel serves."""
    idx = torch.from_numpy(selected)
    if len(selected) == common.num_reqs:
        return _KernelGroup(idx, None, common.block_tables.contiguous(), common.query_start_loc, common.seq_lens,
                            torch.get_num_threads())
    q_lens = common.query_lens_cpu[selected]
    query_start_loc = np.zeros(len(selected) + 1, np.int32)
    np.cumsum(q_lens, out=query_start_loc[1:])
    batch_starts = np.cumsum(common.query_lens_cpu) - common.query_lens_cpu
    shift = (batch_starts[selected] - query_start_loc[:-1]).astype(np.int64)    # batch index - group index
    rows = np.repeat(shift, q_lens) + np.arange(query_start_loc[-1])
    return _KernelGroup(idx, torch.from_numpy(rows), common.block_tables[idx].contiguous(),
                        torch.from_numpy(query_start_loc), common.seq_lens[idx].contiguous(), torch.get_num_threads())


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
