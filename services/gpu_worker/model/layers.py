"""Small Llama building blocks: RMSNorm (optionally fused with the residual add) and the gated MLP (gate and up
fused into one matmul). `ops` and `linear` come from the KernelPlan (kernel_plan.py): torch, the fused Triton
kernels or the CPU's C kernels."""

from __future__ import annotations

import torch
from torch import nn

from services.gpu_worker.model.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops=TorchOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))   # [hidden]
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, hidden] -> normalized x; with residual [T, hidden] -> (norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops=TorchOps, linear=nn.Linear):
        super().__init__()
        self.intermediate_size, self.ops = intermediate_size, ops
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size, bias)  # [2I, hidden]: gate; up
        self.down_proj = linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
