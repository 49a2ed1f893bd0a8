"""Rotary position embedding (HF Llama convention: rotate_half over two halves), with llama3/linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from services.gpu_worker.model.ops import TorchOps


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, scaled as config.json's rope_scaling says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3 are)")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 ops=TorchOps):
        super().__init__()
        self.ops = ops
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)   # [max_positions, head_dim]
        self.register_buffer("sin", torch.empty(0), persistent=False)   # [max_positions, head_dim]

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """Fill the cos/sin tables (fp32 math, then cast to the model dtype as transformers does)."""
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D]; k [T, Hk, D] -> rotated q, k (the triton ops rotate in place)."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)
