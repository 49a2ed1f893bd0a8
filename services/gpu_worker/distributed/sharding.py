"""Cutting checkpoint tensors into one rank's share (Megatron's layout), as they are read.

    column-parallel (output rows split)   q/k/v_proj, gate/up_proj (weights and biases), embed_tokens, lm_head
    row-parallel (input columns split)    o_proj, down_proj; their bias is added once, on rank 0
    replicated                            norms (per-head q/k norms included), MoE routers, everything else
    mixture of experts                    each expert's gate/up (w1/w3) rows and down (w2) columns, as the dense
                                          MLP's, and the shared expert's; expert parallel: routed experts whole
                                          (the loader skips the ones another rank holds)

A rank's q heads are [first_head, first_head + num_heads); its KV heads [first_kv_head, + num_kv_heads), one
replicated head when N > num_kv_heads. The vocabulary is padded to a multiple of N with zero rows (their logits
are dropped after the gather). Checkpoints that hold q/k/v or gate/up fused (Phi-3) are split into their parts.
"""

from __future__ import annotations

import re

import torch

from steploop.gpu_worker.distributed.shapes import RankShare
from steploop.gpu_worker.model.model_config import ModelConfig

_COLUMN = re.compile(r"\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_FUSED = re.compile(r"\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERT = re.compile(r"\.(experts\.\d+|shared_expert)\.(w1|w3|gate_proj|up_proj|w2|down_proj)\.weight$")


class CheckpointSharder:
    """shard(name, tensor) -> this rank's part of a checkpoint tensor (the tensor itself when replicated)."""

    def __init__(self, cfg: ModelConfig, share: RankShare):
        self.cfg, self.share = cfg, share
        d = cfg.head_dim
        self._rows = {"q": (share.first_head * d, share.num_heads * d),
                      "k": (share.first_kv_head * d, share.num_kv_heads * d),
                      "v": (share.first_kv_head * d, share.num_kv_heads * d),
                      "gate": (share.rank * share.intermediate, share.intermediate),
                      "up": (share.rank * share.intermediate, share.intermediate)}

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in _VOCAB:
            return self._vocab_rows(tensor)
        if m := _COLUMN.search(name):
            start, size = self._rows[m.group(2) or m.group(3)]
            return tensor[start:start + size]
        if m := _EXPERT.search(name):
            return self._expert_part(m.group(1) == "shared_expert", m.group(2) in ("w2", "down_proj"), tensor)
        if m := _FUSED.search(name):
            return self._split_fused(m.group(1), tensor)
        if m := _ROW.search(name):
            if m.group(2) == "bias":
                return tensor if self.share.rank == 0 else torch.zeros_like(tensor)
            part = "q" if "o_proj" in m.group(1) else "gate"
            start, size = self._rows[part]
            return tensor[:, start:start + size]
        return tensor

    def _expert_part(self, shared: bool, down: bool, tensor: torch.Tensor) -> torch.Tensor:
        if not shared and self.share.expert_parallel:
            return tensor
        size = self.share.shared_intermediate if shared else self.share.moe_intermediate
        start = self.share.rank * size
        return tensor[:, start:start + size] if down else tensor[start:start + size]

    def _split_fused(self, which: str, tensor: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if which.endswith("qkv_proj"):
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            parts = dict(zip("qkv", tensor.split([q, kv, kv])))
        else:
            parts = dict(zip(("gate", "up"), tensor.split([cfg.intermediate_size] * 2)))
        return torch.cat([parts[p][s:s + n] for p, (s, n) in ((p, self._rows[p]) for p in parts)])

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        start, rows = self.share.first_vocab_row, self.share.vocab_rows
        part = tensor[start:start + rows]
        if part.shape[0] == rows:
            return part
        padded = torch.zeros((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        padded[:part.shape[0]] = part
        return padded
