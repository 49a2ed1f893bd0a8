"""The attention backend interface. A backend plans once per step, then runs every layer from that plan.

    backend.serve_variant(layer, window, softcap)             # at model build, per windowed / soft-capped layer
    metadata = backend.build_metadata(common)                 # once per step
    out = backend.forward(layer, q, k, v, kv_cache, metadata)  # per layer: write K/V by slot, attend

The backends (torch_backend.py, triton_backend.py) implement it; selector.py builds the one a plan names. This
module imports neither, so the backends import it without a cycle.

KV cache layout (one tensor per layer): [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 = K, 1 = V.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from steploop.gpu_worker.attention.metadata import CommonAttentionMetadata


class AttentionBackend(ABC):
    name: str = ""
    supports_fp8_kv = False     # reads an FP8 KV cache (--kv-cache-dtype fp8*): the Triton kernels only

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def serve_variant(self, layer: int, window: int | None, softcap: float | None) -> bool:
        """Attend `layer` with a sliding window (keys p - window < j <= p) and/or soft-capped logits from now on.
        False: this backend cannot, and the model attends that layer in torch (model/windowed_attention.py)."""
        return False

    def stage_metadata(self, query_lens_cpu: Any, seq_lens_cpu: Any, staging: Any) -> Any:
        """Before the step's one host-to-device copy (staging.py): put the host-planned arrays this backend needs in
        `staging`; what it returns comes back to build_metadata as `staged`. None: nothing to stage."""
        return None

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata, max_seq_len_hint: int | None = None,
                       staged: Any = None) -> Any:
        """Everything the layers need for this step, computed once (index tensors, masks, grids).

        max_seq_len_hint: the longest context any later step replaying this metadata may have (CUDA graphs build
        it once at capture); None means this step's own contexts. Backends that plan every step ignore it.
        staged: (the step's StepStaging, what stage_metadata returned), or None (plan without it)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hk, D] for the step's new tokens; writes k/v into kv_cache by slot, then
        returns the attention output [T, H, D] over each token's context (cached tokens and new ones up to it)."""

