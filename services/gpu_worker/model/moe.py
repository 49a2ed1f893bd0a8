"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE) in torch: a router, top-k experts per token, renormalised as the
config says, each expert a gated MLP. The torch path, exact against transformers (the same fp32 softmax, top-k,
and weighted sum per expert); experts run one after another over the tokens routed to them. On CUDA the experts
run in the Triton fused-MoE kernel instead (tokens sorted by expert, one grouped GEMM per projection).

Weights: w13 [E, 2I, hidden] (each expert's gate rows, then up rows), w2 [E, hidden, I]; the loader copies
Mixtral's experts.N.w1/w3/w2 and Qwen3-MoE's experts.N.gate_proj/up_proj/down_proj into them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int              # per expert
    renormalize: bool                   # divide the top-k weights by their sum (Mixtral: always; Qwen3: norm_topk_prob)
    module: str                         # the checkpoint's name of the MoE block: "block_sparse_moe" or "mlp"
    sparse_layers: tuple[int, ...]      # the layers that are MoE; the others keep the dense MLP


def fused_kernel_serves(x: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA only (importing triton elsewhere would cost the CPU worker for nothing)."""
    return x.is_cuda


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec, act: str):
        super().__init__()
        self.spec, self.act = spec, act
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)            # the router
        self.w13 = nn.Parameter(torch.empty(spec.num_experts, 2 * spec.intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(spec.num_experts, hidden_size, spec.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)                   # [T, E]
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)                # [T, k]
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self._experts(x, weights.to(x.dtype), experts)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, weights/experts [T, k] -> [T, hidden]: on CUDA the Triton fused-MoE
        kernel (kernels/fused_moe.py, two grouped GEMMs); elsewhere each expert in turn over its tokens."""
        if fused_kernel_serves(x):
            from services.gpu_worker.kernels.fused_moe import fused_experts
            return fused_experts(x, self.w13, self.w2, weights, experts, self.act)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.w13[e]).chunk(2, dim=-1)
            h = F.linear(self._activate(gate) * up, self.w2[e])
            out.index_add_(0, token, h * weights[token, slot, None])
        return out

    def _activate(self, gate: torch.Tensor) -> torch.Tensor:
        if self.act == "silu":
            return F.silu(gate)
        return F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none")


_EXPERT = re.compile(r"^(model\.layers\.\d+\.)(?:block_sparse_moe|mlp)\.(?:experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|"
                     r"down_proj)|(gate))\.weight$")
_ROWS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


def expert_target(name: str, spec: MoESpec) -> tuple[str, int | None, tuple[int, int] | None] | None:
    """A checkpoint's router / expert tensor -> (our parameter, expert, row slice); None for any other tensor."""
    m = _EXPERT.match(name)
    if not m or int(name.split(".")[2]) not in spec.sparse_layers:
        return None
    prefix, expert, piece, router = m.groups()
    if router:
        return f"{prefix}mlp.gate.weight", None, None
    if piece in ("w2", "down_proj"):
        return f"{prefix}mlp.w2", int(expert), None
    start = _ROWS[piece] * spec.intermediate_size
    return f"{prefix}mlp.w13", int(expert), (start, start + spec.intermediate_size)
