"""FP8 bytes to fp32 inside Triton kernels, exactly, on every GPU generation.

Kernels take e4m3 / e5m2 tensors as their bytes (uint8 views) and decode them with integer arithmetic, so the same
code runs on sm_80 (no fp8 conversion instructions), sm_89+ and the interpreter. Callers never pass NaN bytes: the
writers clamp to the format's finite range first.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_to_fp32(b):
    """uint8 e4m3fn bytes -> their exact fp32 values."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)          # 2^(e - 10)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2)        # subnormal m * 2^-9, else (8 + m) * 2^(e-10)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def e5m2_to_fp32(b):
    """uint8 e5m2 bytes -> their exact fp32 values (an e5m2 byte is the high byte of the fp16 of the same value)."""
    return (b.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
