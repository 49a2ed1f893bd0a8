"""The model's elementwise ops in two implementations with one interface: plain torch (the oracle, and the CPU
serving path) and the fused Triton kernels (used with the triton attention backend); the KernelPlan picks
(kernel_plan.py; the CPU's C kernels are model/cpu_ops.py).

    rms_norm(x, w, eps)                -> y
    rms_norm(x, w, eps, residual)      -> (y, x + residual)      (triton: both written in place)
    rotary(positions, q, k, cos, sin)  -> (q', k')               (triton: in place)
    silu_and_mul(x [T, 2I])            -> silu(gate) * up [T, I]
    argmax_rows(x [R, C])              -> x.argmax(-1) [R]       (greedy sampling; CpuOps has a C kernel)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        if residual is not None:
            residual = x + residual
            return TorchOps.rms_norm(residual, weight, eps), residual
        h = x.float()                                            # variance in fp32, as transformers does
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)   # [T, 1, D]
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def argmax_rows(x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)


class TritonOps:
    name = "triton"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        from steploop.gpu_worker.kernels.fused import rms_norm
        return rms_norm(x, weight, eps, residual)

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from steploop.gpu_worker.kernels.fused import rotary_neox
        return rotary_neox(positions, q, k, cos, sin)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        from steploop.gpu_worker.kernels.fused import silu_and_mul
        return silu_and_mul(x)

    argmax_rows = TorchOps.argmax_rows


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
