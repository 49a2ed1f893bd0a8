"""Paged attention with the Triton kernels: the same AttentionBackend interface as the torch oracle.

    stage_metadata(...)     once per step, before the step's one copy: plan the query tiles (host, numpy), staged
    build_metadata(common)  once per step: the tiles' device views and the split count -> plan
    forward(layer, ...)     per layer: write K/V by slot (one launch), attend (one launch, two with split-KV)

Layers with a sliding window or soft-capped logits (Mistral, Gemma 2/3 local layers, Gemma 2's caps) run the same
kernel with those constexprs on (serve_variant, called as the model is built); the step's plan serves every layer,
so they replay in CUDA graphs like the others.

An FP8 KV cache (--kv-cache-dtype) is written and read with each layer's (k_scale, v_scale): set_kv_scales puts them
on the device once, before any step or capture.

Requires the kernels to run: a CUDA device, or TRITON_INTERPRET=1 set before the first import (CPU tensors;
for tests only, it is slow).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steploop.gpu_worker import kv_cache_dtype
from steploop.gpu_worker.attention.backend import AttentionBackend
from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata
from steploop.gpu_worker.kernels.cache_write import write_kv_cache
from steploop.gpu_worker.kernels.launch_config import LaunchConfig
from steploop.gpu_worker.kernels.paged_attention import (
    AttentionPlan,
    plan_attention,
    plan_tiles,
    unified_attention,
)
from steploop.gpu_worker.staging import StepStaging


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    slot_mapping: torch.Tensor   # [T] int64, -1 = skip (CUDA-graph padding)
    plan: AttentionPlan


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 num_splits: int | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.num_splits = num_splits   # None: the launcher's heuristic; tests force 1 or N
        self.variants: dict[int, tuple[int | None, float | None]] = {}   # layer -> (window, softcap)
        self.launch: dict[str, LaunchConfig] = {}    # shape class -> tuned num_warps/num_stages (kernels/tuning.py)
        self.kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> FP8 (k_scale, v_scale)

    supports_fp8_kv = True

    def set_kv_scales(self, scales: dict[int, tuple[float, float]], device: torch.device) -> None:
        """layer -> (k_scale, v_scale) for an FP8 cache: one-element fp32 tensors on the device, read by the
        kernels at run time."""
        self.kv_scales = {layer: (torch.tensor([k], dtype=torch.float32, device=device),
                                  torch.tensor([v], dtype=torch.float32, device=device))
                          for layer, (k, v) in scales.items()}

    def scales_for(self, layer: int, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`layer`'s (k_scale, v_scale) for an FP8 cache; None for a cache of the model's dtype."""
        if not kv_cache_dtype.is_fp8(kv_cache.dtype):
            return None
        if layer not in self.kv_scales:
            raise ValueError(f"layer {layer}: a {kv_cache.dtype} KV cache without set_kv_scales")
        return self.kv_scales[layer]

    def serve_variant(self, layer: int, window: int | None, softcap: float | None) -> bool:
        self.variants[layer] = (window, softcap)
        return True

    def stage_metadata(self, query_lens_cpu: np.ndarray, seq_lens_cpu: np.ndarray,
                       staging: StepStaging) -> tuple[int, int, int]:
        """The query tiles, planned on the host and put in the step's staging (they travel in its one copy)."""
        tile_req, tile_qstart, block_q = plan_tiles(query_lens_cpu, self.num_heads, self.num_kv_heads)
        return staging.put(tile_req), staging.put(tile_qstart), block_q

    def build_metadata(self, common: CommonAttentionMetadata, max_seq_len_hint: int | None = None,
                       staged: tuple[StepStaging, tuple[int, int, int]] | None = None) -> TritonAttentionMetadata:
        tiles = None
        if staged is not None:
            staging, (req, qstart, block_q) = staged
            tiles = (staging.get(req), staging.get(qstart), block_q)
        plan = plan_attention(common.query_start_loc, common.seq_lens, common.block_tables, common.query_lens_cpu,
                              common.seq_lens_cpu, self.num_heads, self.num_kv_heads, self.num_splits,
                              max_seq_len_hint, tiles, self.launch)
        return TritonAttentionMetadata(common, common.slot_mapping, plan)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata) -> torch.Tensor:
        scales = self.scales_for(layer, kv_cache)
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)    # [T, H, D]
        window, softcap = self.variants.get(layer, (None, None))
        return unified_attention(q, kv_cache, out, metadata.plan, self.scale, window, softcap, scales)
