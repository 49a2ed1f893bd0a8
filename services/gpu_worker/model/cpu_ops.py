"""CpuOps: the model's elementwise ops as C kernels (cpu_kernels/elementwise.c) for fp32 CPU tensors, TorchOps for
anything else. Same interface as TorchOps (model/ops.py); rms_norm with a residual and rotary work in place, like
TritonOps. At decode batch sizes each torch op costs more in dispatch than in arithmetic: one call instead of 5-10
ops per norm / rotation / activation is ~10 ms of a 16-request decode step on 2 cores.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common import envs
from services.gpu_worker.cpu_kernels import elementwise as kernel
from services.gpu_worker.model.ops import TorchOps


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


class CpuOps:
    name = "cpu"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        parts = (x, weight) if residual is None else (x, weight, residual)
        if _fits(*parts) and x.dim() == 2 and all(t.is_contiguous() for t in parts):
            return kernel.rms_norm(x, weight, eps, residual)
        return TorchOps.rms_norm(x, weight, eps, residual)

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows_ok = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k))
        if _fits(q, k, cos, sin) and rows_ok and cos.is_contiguous() and sin.is_contiguous():
            return kernel.rotary(positions, q, k, cos, sin)
        return TorchOps.rotary(positions, q, k, cos, sin)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if _fits(x) and x.dim() == 2 and x.is_contiguous():
            return kernel.silu_and_mul(x)
        return TorchOps.silu_and_mul(x)


def use_cpu_ops(model: nn.Module) -> str:
    """Point every module that uses TorchOps at CpuOps; returns a one-line summary for the log."""
    off = envs.switched_off(envs.CPU_KERNELS)
    if off:
        return f"torch ({off}=0)"
    if not kernel.available():
        return "torch (the elementwise kernels did not build)"
    swapped = 0
    for module in model.modules():
        if getattr(module, "ops", None) is TorchOps:
            module.ops = CpuOps
            swapped += 1
    return f"C kernels in {swapped} modules (RMSNorm, rotary, SiLU-and-mul)"
