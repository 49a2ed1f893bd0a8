"""Paged attention in torch for the layers a backend does not serve itself (the torch backend; the triton kernel
serves them): a sliding window (Mistral, Qwen2/3 with use_sliding_window, Gemma 2/3 local layers, Phi-3) and/or
tanh soft-capping of the logits (Gemma 2).

Works beside any backend: it reads only the step's CommonAttentionMetadata (metadata.common) and the paged cache
layout [2, num_blocks, block_size, Hk, D]. Per step it plans once (cached on the backend's metadata object), as the
torch backend does: requests split into decodes and the rest, each group padded to its longest query, block tables
gathered whole. The mask is key j attends from query position p iff p - window < j <= p (transformers'
sliding_window_overlay). Soft-capping: logits = cap * tanh(logits / cap) before the mask and the fp32 softmax.

Image spans (Gemma 3 with images, set by the worker on the step's metadata as `image_spans`: batch row -> the
[lo, hi) placeholder ranges its chunk computes): a query inside a span also attends to every key of that span,
before or after it, whatever the window (transformers' token_type_ids_mask_function, ORed onto the causal and the
sliding masks). The scheduler keeps each span whole in one chunk, so its later keys are this step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata
from steploop.gpu_worker.attention.torch_backend import write_kv

QUERY_CHUNK = 256   # soft-capped logits are materialised per this many query rows (bounded memory)


@dataclass
class _Group:
    q_index: torch.Tensor      # [g, max_q] flat token index of each padded query
    q_valid: torch.Tensor      # [g, max_q] bool
    out_index: torch.Tensor    # [n] flat token index of each valid query, row-major
    flat_tables: torch.Tensor  # [g * nb] block ids
    num_reqs: int
    query_pos: torch.Tensor    # [g, max_q] position of each padded query in its request
    key_valid: torch.Tensor    # [g, max_q, nb * block_size] causal and in-context, before any window
    masks: dict = field(default_factory=dict)   # window -> [g, 1, max_q, nb * block_size] bool
    same_image: torch.Tensor | None = None      # [g, max_q, nb * block_size]: query and key in one image span

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            m = self.key_valid
            if window is not None:
                j = torch.arange(m.shape[-1], device=m.device)
                m = m & (j[None, None, :] > self.query_pos[:, :, None] - window)
            if self.same_image is not None:
                m = m | self.same_image
            self.masks[window] = m.unsqueeze(1)
        return self.masks[window]


def _plan(common: CommonAttentionMetadata, image_spans: dict[int, list[tuple[int, int]]] | None = None
          ) -> list[_Group]:
    is_decode = common.query_lens_cpu == 1
    groups = []
    for sel in (is_decode, ~is_decode):
        rows = np.flatnonzero(sel)
        if len(rows):
            g = _build_group(common, torch.from_numpy(rows).to(common.seq_lens.device))
            if image_spans and any(r in image_spans for r in rows.tolist()):
                g.same_image = _same_image(g, rows, image_spans)
            groups.append(g)
    return groups


def _same_image(g: _Group, rows: np.ndarray, image_spans: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    """[g, max_q, L] bool: query and key positions lie in the same image span of their request."""
    length = g.key_valid.shape[-1]
    key_image = np.full((len(rows), length), -1, dtype=np.int64)     # span number of each key position, -1: text
    for i, row in enumerate(rows.tolist()):
        for n, (lo, hi) in enumerate(image_spans.get(row, ())):
            key_image[i, lo:hi] = n
    key_image = torch.from_numpy(key_image).to(g.key_valid.device)
    query_image = key_image.gather(1, g.query_pos.clamp(max=length - 1))
    query_image = torch.where(g.q_valid, query_image, -1)
    return (query_image[:, :, None] == key_image[:, None, :]) & (query_image[:, :, None] >= 0)


def _build_group(common: CommonAttentionMetadata, idx: torch.Tensor) -> _Group:
    device = common.seq_lens.device
    q_lens, s_lens = common.query_lens[idx].long(), common.seq_lens[idx].long()
    starts = common.query_start_loc[idx].long()
    host_idx = idx.cpu().numpy()
    max_q = int(common.query_lens_cpu[host_idx].max())
    num_blocks = -(-int(common.seq_lens_cpu[host_idx].max()) // common.block_size)
    i = torch.arange(max_q, device=device)
    j = torch.arange(num_blocks * common.block_size, device=device)
    q_valid = i[None, :] < q_lens[:, None]
    q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0)
    query_pos = (s_lens - q_lens)[:, None] + i[None, :]                        # [g, max_q]
    key_valid = (j[None, None, :] <= query_pos[:, :, None]) & (j[None, None, :] < s_lens[:, None, None])
    tables = common.block_tables[idx, :num_blocks].long()
    return _Group(q_index, q_valid, q_index[q_valid], tables.reshape(-1), len(host_idx), query_pos, key_valid)


class WindowedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int | None,
                 softcap: float | None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window, self.softcap = scale, window, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hk, D]: write k/v by slot, attend -> [T, H, D]."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("sliding-window / soft-capped layers run in torch and plan on the host each step: "
                               "they cannot be captured in a CUDA graph (start the worker with --no-cuda-graphs)")
        common = metadata.common
        write_kv(kv_cache, k, v, common.slot_mapping)
        groups = metadata.__dict__.get("_windowed_plan")
        if groups is None:
            groups = metadata.__dict__["_windowed_plan"] = _plan(common, metadata.__dict__.get("image_spans"))
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        for g in groups:
            out[g.out_index] = self._attend(q, kv_cache, g)
        return out

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        k, v = (kv_cache[i].index_select(0, g.flat_tables).view(g.num_reqs, -1, self.num_kv_heads, self.head_dim)
                .transpose(1, 2).to(q.dtype) for i in (0, 1))     # [g, Hk, L, D]
        qg = q[g.q_index].transpose(1, 2)                         # [g, H, max_q, D]
        mask = g.mask(self.window)
        if self.softcap is None:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            o = self._softcapped(qg, k, v, mask)
        return o.transpose(1, 2)[g.q_valid]                       # [n, H, D]

    def _softcapped(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # [g, H, L, D]: head h reads h // rep
        out = torch.empty_like(qg)
        for start in range(0, qg.shape[2], QUERY_CHUNK):
            rows = slice(start, start + QUERY_CHUNK)
            logits = torch.matmul(qg[:, :, rows], k.transpose(-1, -2)) * self.scale
            logits = torch.tanh(logits / self.softcap) * self.softcap
            logits = logits.masked_fill(~mask[:, :, rows], float("-inf"))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(qg.dtype)
            out[:, :, rows] = torch.matmul(probs, v)
        return out
