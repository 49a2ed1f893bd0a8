"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE): a router, top-k experts per token, renormalised as
the config says, each expert a gated MLP; Qwen2-MoE adds a shared expert every token takes, scaled by
sigmoid(shared_expert_gate(x)). The torch path, exact against transformers (the same fp32 softmax, top-k,
and weighted sum per expert), runs the experts one after another over the tokens routed to them; on CUDA the
routed experts run in the Triton fused-MoE kernel instead (tokens sorted by expert, one grouped GEMM per projection).

Weights: w13 [E, 2I, hidden] (each expert's gate rows, then up rows), w2 [E, hidden, I]; the loader copies
Mixtral's experts.N.w1/w3/w2 and Qwen3-MoE's experts.N.gate_proj/up_proj/down_proj into them; Qwen2-MoE's
shared_expert.gate_proj/up_proj/down_proj go into shared_w13 / shared_w2, shared_expert_gate into shared_gate.

On a rank of a tensor-parallel group (distributed/shapes.py: local_moe_spec) the block holds the rank's share and
returns its partial sum, which the layer's one all-reduce completes (distributed/parallel_layers.py):
    sharded (-tp N)            every expert, I / N of its gate/up rows and down columns; E stays E
    expert parallel (--enable-expert-parallel)   experts [first_expert, first_expert + local_experts) whole;
                               the other experts' tokens are skipped here and computed on their owner's rank
The router is replicated; the shared expert is sharded by rows / columns in both modes.

A GGUF file's experts on the CPU (gguf/weights.py) come packed instead: use_packed replaces w13 / w2 (or the
shared expert's) by one packed weight per expert, read at the file's width by the packed C kernels, and drops
the fp32 parameter (never filled). A GPTQ / AWQ / compressed-tensors checkpoint's experts (quant/loading.py) come
as one QuantLinear per expert the same way (use_quantized), at their stored width; the routed experts then run one
after another on CUDA too (the fused kernel reads fp32 / bf16 stacks).
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
    shared_intermediate_size: int = 0   # Qwen2-MoE's shared expert (sigmoid-gated); 0: none
    first_expert: int = 0               # expert parallel: the first expert this rank holds
    local_experts: int = 0              # expert parallel: how many it holds (0: all num_experts)

    @property
    def held_experts(self) -> int:
        return self.local_experts or self.num_experts

    def holds(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.held_experts


def fused_kernel_serves(x: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA only (importing triton elsewhere would cost the CPU worker for nothing)."""
    return x.is_cuda


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec, act: str):
        super().__init__()
        self.spec, self.act = spec, act
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)            # the router
        held = spec.held_experts
        self.w13 = nn.Parameter(torch.empty(held, 2 * spec.intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(held, hidden_size, spec.intermediate_size))
        if spec.shared_intermediate_size:
            self.shared_w13 = nn.Parameter(torch.empty(2 * spec.shared_intermediate_size, hidden_size))
            self.shared_w2 = nn.Parameter(torch.empty(hidden_size, spec.shared_intermediate_size))
            self.shared_gate = nn.Linear(hidden_size, 1, bias=False)
        self.packed_experts: dict[str, object] = {}   # w13 -> [PackedWeight per expert]; shared_w13 -> PackedWeight

    def use_packed(self, name: str, weight) -> None:
        """name: w13 / w2 (weight: one PackedWeight per held expert) or shared_w13 / shared_w2 (one)."""
        self.packed_experts[name] = weight
        setattr(self, name, None)               # the fp32 parameter goes (the slot stays, empty)

    def use_quantized(self, name: str, layers: list[nn.Module]) -> None:
        """name: w13 / w2 (one QuantLinear per held expert, in order) or shared_w13 / shared_w2 (one)."""
        for i, layer in enumerate(layers):
            self.add_module(f"quantized_{name}_{i}", layer)     # a submodule: moved and counted with the model
        self.use_packed(name, layers if name in ("w13", "w2") else layers[0])

    def _weight(self, name: str):
        return self.packed_experts.get(name, getattr(self, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)                   # [T, E]
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)                # [T, k]
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self._experts(x, weights.to(x.dtype), experts)
        if self.spec.shared_intermediate_size:   # Qwen2-MoE: every token also takes the gated shared expert
            shared = self._expert(x, self._weight("shared_w13"), self._weight("shared_w2"))
            out = out + torch.sigmoid(self.shared_gate(x)) * shared
        return out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, weights/experts [T, k] -> [T, hidden]: on CUDA the Triton fused-MoE
        kernel (kernels/fused_moe.py, two grouped GEMMs) when both stacks are held as tensors; elsewhere, or with
        either held per expert (packed or quantized), each expert in turn over its tokens. Only the
        experts this rank holds contribute (expert parallel: the others are zero here)."""
        spec = self.spec
        if fused_kernel_serves(x) and isinstance(self.w13, torch.Tensor) and isinstance(self.w2, torch.Tensor):
            from steploop.gpu_worker.kernels.fused_moe import fused_experts
            return fused_experts(x, self.w13, self.w2, weights, experts, self.act,
                                 first_expert=spec.first_expert if spec.local_experts else None)
        out = torch.zeros_like(x)
        w13, w2 = self._weight("w13"), self._weight("w2")
        for e in torch.unique(experts).tolist():
            if not spec.holds(e):
                continue
            token, slot = torch.where(experts == e)
            local = e - spec.first_expert
            h = self._expert(x[token], w13[local], w2[local])
            out.index_add_(0, token, h * weights[token, slot, None])
        return out

    def _expert(self, x: torch.Tensor, w13, w2) -> torch.Tensor:
        gate, up = _linear(x, w13).chunk(2, dim=-1)
        return _linear(self._activate(gate) * up, w2)

    def _activate(self, gate: torch.Tensor) -> torch.Tensor:
        if self.act == "silu":
            return F.silu(gate)
        return F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none")


def _linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for an fp32 weight, a QuantLinear, or a PackedWeight (the packed C kernel, imported only when one is
    used)"""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if isinstance(w, nn.Module):
        return w(x)
    from steploop.gpu_worker.cpu_kernels.packed_linear import packed_linear
    return packed_linear(x, w, torch.get_num_threads())


_EXPERT = re.compile(r"^(model\.layers\.\d+\.)(?:block_sparse_moe|mlp)\.(?:(experts\.\d+|shared_expert)\.(w1|w2|w3|"
                     r"gate_proj|up_proj|down_proj)|(gate|shared_expert_gate))\.weight$")
_ROWS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


NOT_HELD = ("", None, None)     # expert_target's answer for an expert another rank holds (expert parallel)


def expert_target(name: str, spec: MoESpec) -> tuple[str, int | None, tuple[int, int] | None] | None:
    """A checkpoint's router / expert tensor -> (our parameter, local expert index, row slice); None for any other
    tensor; NOT_HELD for an expert of another rank. Rows are in this rank's (possibly sharded) intermediate size."""
    m = _EXPERT.match(name)
    if not m or int(name.split(".")[2]) not in spec.sparse_layers:
        return None
    prefix, owner, piece, router = m.groups()
    if router:
        return f"{prefix}mlp.{'shared_gate' if router == 'shared_expert_gate' else 'gate'}.weight", None, None
    shared = owner == "shared_expert"
    expert, name, size = (None, "shared_", spec.shared_intermediate_size) if shared else \
        (int(owner.split(".")[1]), "", spec.intermediate_size)
    if expert is not None:
        if not spec.holds(expert):
            return NOT_HELD
        expert -= spec.first_expert
    if piece in ("w2", "down_proj"):
        return f"{prefix}mlp.{name}w2", expert, None
    start = _ROWS[piece] * size
    return f"{prefix}mlp.{name}w13", expert, (start, start + size)
