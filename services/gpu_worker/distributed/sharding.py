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
        if _FUSED.search(name):
            return self._split_fused(_FUSED.search(name).group(1), tensor)
        if (m := _ROW.search(name)) and m.group(2) == "bias":
            return tensor if self.share.rank == 0 else torch.zeros_like(tensor)
        split = self.split(name)
        if split is None:
            return tensor
        dim, start, size = split
        return tensor[start:start + size] if dim == 0 else tensor[:, start:start + size]

    def split(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, size): this rank's part of a weight (or column-parallel bias) cut along one dimension,
        0 rows (column-parallel), 1 input columns (row-parallel); None when the rank holds it whole (replicated,
        an expert held whole). Not for the vocabulary tensors (padded rows) or fused checkpoint layers."""
        if m := _COLUMN.search(name):
            return (0, *self._rows[m.group(2) or m.group(3)])
        if m := _EXPERT.search(name):
            return self._expert_part(m.group(1) == "shared_expert", m.group(2) in ("w2", "down_proj"))
        if (m := _ROW.search(name)) and m.group(2) == "weight":
            return (1, *self._rows["q" if "o_proj" in m.group(1) else "gate"])
        return None

    def full_shape(self, name: str) -> tuple[int, int]:
        """[out, in] of a decoder layer's attention / dense MLP linear in the whole (unsplit) checkpoint."""
        cfg = self.cfg
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shapes = {"q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size), "v_proj": (kv, cfg.hidden_size),
                  "o_proj": (cfg.hidden_size, q), "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
                  "up_proj": (cfg.intermediate_size, cfg.hidden_size),
                  "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
        return shapes[name.rsplit(".", 2)[-2]]

    def _expert_part(self, shared: bool, down: bool) -> tuple[int, int, int] | None:
        if not shared and self.share.expert_parallel:
            return None
        size = self.share.shared_intermediate if shared else self.share.moe_intermediate
        return (1 if down else 0, self.share.rank * size, size)

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
