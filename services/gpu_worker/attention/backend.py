"""The attention backend interface. A backend plans once per step, then runs every layer from that plan.

    metadata = backend.build_metadata(common)                 # once per step
    out = backend.forward(layer, q, k, v, kv_cache, metadata)  # per layer: write K/V by slot, attend

KV cache layout (one tensor per layer): [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 = K, 1 = V.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from services.gpu_worker.attention.metadata import CommonAttentionMetadata


class AttentionBackend(ABC):
    name: str = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Everything the layers need for this step, computed once (index tensors, masks, grids)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hk, D] for the step's new tokens; writes k/v into kv_cache by slot, then
        returns the attention output [T, H, D] over each token's context (cached tokens and new ones up to it)."""


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter k/v [T, Hk, D] into kv_cache [2, num_blocks, block_size, Hk, D] at slot_mapping [T]."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])   # [2, num_slots, Hk, D]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def create_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> AttentionBackend:
    """name is a resolved backend (WorkerConfig.resolved_attention_backend turns "auto" into one of these)."""
    if name == "torch":
        from services.gpu_worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    if name == "triton":
        from services.gpu_worker.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"--attention-backend {name!r} is not available (choose: torch, triton)")
