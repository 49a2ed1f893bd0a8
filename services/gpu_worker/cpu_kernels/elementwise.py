"""ctypes front end of elementwise.c: RMSNorm (+ residual), rotary (NeoX halves), SiLU-and-mul and a row argmax, fp32
on the CPU.

model/cpu_ops.py's CpuOps calls these with the same interface as TorchOps; `available()` builds the library once.
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace

import torch

from steploop.gpu_worker.cpu_kernels.build import function

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def _kernels() -> SimpleNamespace | None:
    fns = {"rms_norm": function("steploop_rms_norm", [_PTR] * 4 + [_I64, _I64, _F32, _INT]),
           "rotary": function("steploop_rotary_neox", [_PTR] * 5 + [_I64] * 7 + [_INT]),
           "silu_and_mul": function("steploop_silu_and_mul", [_PTR, _PTR, _I64, _I64, _INT]),
           "argmax_rows": function("steploop_argmax_rows", [_PTR, _PTR, _I64, _I64, _INT])}
    return None if None in fns.values() else SimpleNamespace(**fns)


def available() -> bool:
    return _kernels() is not None


def fits_rows(t: torch.Tensor, dim: int) -> bool:
    """A contiguous `dim`-d fp32 CPU tensor: what these kernels take (CpuOps falls back to torch otherwise)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == dim and t.is_contiguous()


def fits_heads(t: torch.Tensor) -> bool:
    """fp32 CPU [T, heads, D] with heads and D contiguous inside a row (a column slice of the fused qkv output)."""
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3 and t.stride(2) == 1
            and t.stride(1) == t.shape[2])


def _fp32_rows(name: str, t: torch.Tensor, dim: int) -> None:
    if not fits_rows(t, dim):
        raise ValueError(f"{name}: expected a contiguous {dim}-d fp32 CPU tensor, got {tuple(t.shape)} {t.dtype} "
                         f"on {t.device} (contiguous: {t.is_contiguous()})")


def _call(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: bad arguments")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, H]: -> y (a new tensor); with residual [T, H]: residual += x, x = norm(residual), returns (x, residual)
    (in place, as the Triton ops do)."""
    _fp32_rows("x", x, 2)
    _fp32_rows("weight", weight, 1)
    if residual is not None:
        _fp32_rows("residual", residual, 2)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    y = x if residual is not None else torch.empty_like(x)
    _call(_kernels().rms_norm(y.data_ptr(), x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                              weight.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads()), "rms_norm")
    return y if residual is None else (y, residual)


def _heads_view(name: str, t: torch.Tensor) -> None:
    if not fits_heads(t):
        raise ValueError(f"{name}: expected fp32 CPU [T, heads, D] with contiguous rows of heads, got "
                         f"{tuple(t.shape)} strides {t.stride()} {t.dtype} on {t.device}")


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hk, D] rotated in place (returned); cos, sin [P, D]; positions [T]."""
    _heads_view("q", q)
    _heads_view("k", k)
    _fp32_rows("cos", cos, 2)
    _fp32_rows("sin", sin, 2)
    pos = positions.to(torch.int64).contiguous()
    t, h, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or pos.shape != (t,) or cos.shape != sin.shape or cos.shape[1] != d:
        raise ValueError(f"rotary: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(pos.shape)}, "
                         f"cos {tuple(cos.shape)}")
    _call(_kernels().rotary(q.data_ptr(), k.data_ptr(), pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, h,
                            k.shape[1], d, q.stride(0), k.stride(0), cos.shape[0], torch.get_num_threads()),
          "rotary (a position past the cos/sin table?)")
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as a new [T, I] tensor."""
    _fp32_rows("x", x, 2)
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: odd width {x.shape[1]}")
    out = x.new_empty((x.shape[0], x.shape[1] // 2))
    _call(_kernels().silu_and_mul(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1] // 2,
                                  torch.get_num_threads()), "silu_and_mul")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, C] -> [R] int64, as x.argmax(dim=-1) (first maximum; a NaN counts as the largest), for fp32 CPU rows;
    anything else goes to torch. torch's took ~2.4 ms on [64, 49152] (2 threads), this ~0.5 ms."""
    if not fits_rows(x, 2) or x.shape[1] == 0:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _call(_kernels().argmax_rows(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads()),
          "argmax_rows")
    return out
