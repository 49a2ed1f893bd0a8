"""Rotary position embedding (HF convention: rotate_half over two halves of the rotated dims).

rope_scaling types: default, linear, dynamic (NTK), yarn, llama3, longrope; partial rotary (Phi's
partial_rotary_factor) rotates the first rotary_dim dims of each head and passes the rest through.

Types whose frequencies transformers recomputes from the sequence length (dynamic, longrope) are static here, so a
cached K never changes: dynamic NTK is the default frequencies within max_position_embeddings (the worker refuses a
longer --max-model-len), exactly as transformers; longrope uses short_factor while max_model_len fits
original_max_position_embeddings (exact), else long_factor for every position (vLLM's choice for long contexts).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from steploop.gpu_worker.model.ops import TorchOps

log = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One layer kind's rotary: dims rotated, base, scaling dict (None = default), model context lengths."""
    rotary_dim: int
    theta: float
    scaling: dict[str, Any] | None
    max_position_embeddings: int
    original_max_position_embeddings: int | None = None   # Phi-3 keeps it beside rope_scaling, not inside


def rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def inverse_frequencies(spec: RopeSpec, max_positions: int) -> tuple[torch.Tensor, float]:
    """([rotary_dim // 2] fp32 inverse frequencies, attention factor applied to cos/sin) for rope_scaling."""
    kind, s, dim = rope_type(spec.scaling), spec.scaling or {}, spec.rotary_dim
    inv_freq = _base_frequencies(spec.theta, dim)
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, s), 1.0
    if kind == "yarn":
        return _yarn(spec, s)
    if kind == "longrope":
        return _longrope(spec, s, max_positions)
    raise ValueError(f"rope_scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)} are)")


def _base_frequencies(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    dim, base, factor = spec.rotary_dim, spec.theta, s["factor"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    old_len = s.get("original_max_position_embeddings") or spec.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                   # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(spec: RopeSpec, s: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    original = spec.original_max_position_embeddings
    factor = spec.max_position_embeddings / original if original else s.get("factor")
    original = original or spec.max_position_embeddings
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    use_long = max_positions > original
    if use_long:
        log.warning("longrope: max_model_len %d > original_max_position_embeddings %d, so every position uses "
                    "long_factor (transformers switches per sequence length; prompts under %d differ from it)",
                    max_positions, original, original)
    ext = torch.tensor(s["long_factor" if use_long else "short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (ext * spec.theta ** (torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64).float()
                                          / spec.rotary_dim))
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 ops=TorchOps, *, rotary_dim: int | None = None, max_position_embeddings: int | None = None,
                 original_max_position_embeddings: int | None = None):
        super().__init__()
        self.ops = ops
        self.head_dim, self.max_positions = head_dim, max_positions
        self.spec = RopeSpec(rotary_dim or head_dim, theta, scaling, max_position_embeddings or max_positions,
                             original_max_position_embeddings)
        self.register_buffer("cos", torch.empty(0), persistent=False)   # [max_positions, rotary_dim]
        self.register_buffer("sin", torch.empty(0), persistent=False)   # [max_positions, rotary_dim]

    @property
    def partial(self) -> bool:
        return self.spec.rotary_dim < self.head_dim

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """Fill the cos/sin tables (fp32 math, then cast to the model dtype as transformers does)."""
        inv_freq, attention_factor = inverse_frequencies(self.spec, self.max_positions)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        emb = torch.cat((torch.outer(pos, inv_freq),) * 2, dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D]; k [T, Hk, D] -> rotated q, k (the triton ops rotate in place)."""
        if not self.partial:
            return self.ops.rotary(positions, q, k, self.cos, self.sin)
        d = self.spec.rotary_dim                         # rotate the first d dims, pass the rest through
        q_rot, k_rot = TorchOps.rotary(positions, q[..., :d], k[..., :d], self.cos, self.sin)
        return torch.cat((q_rot, q[..., d:]), -1), torch.cat((k_rot, k[..., d:]), -1)
