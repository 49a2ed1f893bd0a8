"""FP8 KV cache scales stored in a checkpoint (llm-compressor's kv_cache_scheme, ModelOpt, Quark), per layer.

A checkpoint names them after the attention module that writes the cache, in one of the forms vLLM reads:

    model.layers.N.self_attn.k_scale / .v_scale                (compressed-tensors, ModelOpt)
    model.layers.N.self_attn.attn.k_scale / .v_scale
    model.layers.N.self_attn.k_proj.output_scale / v_proj...   (older compressed-tensors)
    model.layers.N.self_attn.kv_scale                          (one scale for both)

The loader keeps them (KvScales) whatever --kv-cache-dtype is; only an e4m3 cache uses them (kv_cache_dtype.py).
"""

from __future__ import annotations

import logging
import re

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_scale|(k|v)_proj\.output_scale|kv_scale)$")


class KvScales:
    """layer -> {"k": scale, "v": scale}, as read from the checkpoint."""

    def __init__(self) -> None:
        self.stored: dict[int, dict[str, float]] = {}

    def take(self, name: str, read) -> bool:
        """True (and kept) when `name` is a KV scale; read() gives its tensor."""
        m = _NAME.match(name)
        if m is None:
            return False
        tensor: torch.Tensor = read()
        if tensor.numel() != 1:
            raise ValueError(f"{name}: KV cache scales of shape {tuple(tensor.shape)}; steploop reads one scale per "
                             "layer for K and one for V (per-tensor)")
        value = float(tensor.float().reshape(-1)[0])
        if not value > 0.0 or value == float("inf"):
            raise ValueError(f"{name}: KV cache scale {value} must be a positive finite number")
        layer, kind = int(m.group(1)), m.group(2) or m.group(3)
        for k in (kind,) if kind else ("k", "v"):
            self.stored.setdefault(layer, {})[k] = value
        return True

    def for_layers(self, num_layers: int) -> tuple[dict[int, tuple[float, float]], str]:
        """(layer -> (k_scale, v_scale) for every layer, where they came from). A checkpoint with scales for some
        layers only is refused: a layer at 1.0 beside calibrated ones is a silent accuracy loss."""
        if not self.stored:
            return {i: (1.0, 1.0) for i in range(num_layers)}, "1.0 (the checkpoint has no KV scales)"
        missing = [i for i in range(num_layers) if set(self.stored.get(i, {})) != {"k", "v"}]
        if missing:
            raise ValueError(f"the checkpoint has KV cache scales, but not K and V for layers {missing[:8]}")
        return {i: (self.stored[i]["k"], self.stored[i]["v"]) for i in range(num_layers)}, "the checkpoint's"
