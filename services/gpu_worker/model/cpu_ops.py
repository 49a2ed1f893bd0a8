"""CpuOps: the model's elementwise ops as C kernels (cpu_kernels/elementwise.c) for fp32 CPU tensors, TorchOps for
anything else. Same interface as TorchOps (model/ops.py); rms_norm with a residual and rotary work in place, like
TritonOps. At decode batch sizes each torch op costs more in dispatch than in arithmetic: one call instead of 5-10
ops per norm / rotation / activation is ~10 ms of a 16-request decode step on 2 cores. The KernelPlan picks it
(kernel_plan.py: elementwise "cpu") and the layers take it when they are built.
"""

from __future__ import annotations

import torch

from steploop.gpu_worker.cpu_kernels import elementwise as kernel
from steploop.gpu_worker.model.ops import TorchOps


class CpuOps:
    name = "cpu"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        if kernel.fits_rows(x, 2) and kernel.fits_rows(weight, 1) and (residual is None
                                                                        or kernel.fits_rows(residual, 2)):
            return kernel.rms_norm(x, weight, eps, residual)
        return TorchOps.rms_norm(x, weight, eps, residual)

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kernel.fits_heads(q) and kernel.fits_heads(k) and kernel.fits_rows(cos, 2) and kernel.fits_rows(sin, 2):
            return kernel.rotary(positions, q, k, cos, sin)
        return TorchOps.rotary(positions, q, k, cos, sin)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if kernel.fits_rows(x, 2):
            return kernel.silu_and_mul(x)
        return TorchOps.silu_and_mul(x)

    @staticmethod
    def argmax_rows(x: torch.Tensor) -> torch.Tensor:
        return kernel.argmax_rows(x)          # torch's for anything but fp32 CPU rows

