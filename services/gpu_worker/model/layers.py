"""Small Llama building blocks: RMSNorm (optionally fused with the residual add) and the gated MLP (gate and up
fused into one matmul; act(gate) * up with act silu, gelu or gelu_tanh). `ops` and `linear` come from the
KernelPlan (kernel_plan.py): torch, the fused Triton kernels or the CPU's C kernels, for SiLU; the GELU variants
(Gemma's GeGLU) are torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steploop.gpu_worker.model.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops=TorchOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))   # [hidden]
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, hidden] -> normalized x; with residual [T, hidden] -> (norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops=TorchOps, linear=nn.Linear,
                 act: str = "silu"):
        super().__init__()
        self.intermediate_size, self.ops, self.act = intermediate_size, ops, act
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size, bias)  # [2I, hidden]: gate; up
        self.down_proj = linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none") * up)
