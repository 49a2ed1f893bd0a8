"""--kv-cache-dtype (vLLM's flag): what the KV cache stores, and the FP8 scale rule.

    auto              the model's dtype (exact)
    bfloat16          accepted where it is the model's dtype (then the same as auto); a 16-bit cache beside other
                      activations is not built, so it is refused elsewhere
    fp8 / fp8_e4m3    e4m3fn, value = byte * scale, scale per layer for K and for V (the checkpoint's k_scale /
                      v_scale when it has them, else 1.0, as vLLM); half the bytes of a bf16 cache, a quarter of fp32
    fp8_e5m2          e5m2, scale 1.0 (a wider range, one mantissa bit less)

Writes store clamp(x / scale, -max, max) rounded to the format (torch's round-to-nearest-even); reads decode the
byte exactly and multiply by the scale (kernels/fp8_bytes.py). An FP8 cache is not exact: attention sees K and V
rounded to 3 (e4m3) or 2 (e5m2) mantissa bits. Only the Triton attention kernels read it; the torch backend and
the CPU kernels read a cache of the model's dtype, so the worker refuses FP8 there.
"""

from __future__ import annotations

import torch

from steploop.gpu_worker.config import KV_CACHE_DTYPES

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# what the kernels read: 0 the model's dtype, 1 e4m3 bytes, 2 e5m2 bytes (the attention kernel's KV_FP8 constexpr)
KERNEL_CODE = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def resolve(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "bfloat16" and model_dtype != torch.bfloat16:
        raise ValueError(f"--kv-cache-dtype bfloat16 with a {str(model_dtype).removeprefix('torch.')} model: the "
                         "kernels read a cache of the model's dtype (or FP8); use --dtype bfloat16, or auto / fp8")
    return FP8.get(name, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in KERNEL_CODE


def kernel_code(dtype: torch.dtype) -> int:
    return KERNEL_CODE.get(dtype, 0)


def takes_scales(dtype: torch.dtype) -> bool:
    """e4m3 uses per-layer scales (its range is +-448); e5m2 runs at 1.0 (+-57344), as vLLM."""
    return dtype == torch.float8_e4m3fn


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..] in the model's dtype, scale a one-element fp32 tensor -> x / scale clamped to dtype's range, in dtype."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() * scale


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes (a view), anything else as it is: moves that only copy blocks (copy on write, P/D
    gathers, collectives) run on uint8, which every device op and backend has; fp8 types are newer than many."""
    return x.view(torch.uint8) if x.is_floating_point() and x.element_size() == 1 else x
