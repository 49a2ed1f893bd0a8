"""Elementwise math shared by the kernels (@triton.jit helpers, fp32 in and out): tanh without overflow and the
gated activations the model families use (silu, gelu, gelu_tanh as in transformers' ACT2FN)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow for any x."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def activate(x, ACTIVATION: tl.constexpr):
    """silu: x sigmoid(x); gelu: x Phi(x) (erf, exact); gelu_tanh: the tanh approximation (gelu_pytorch_tanh)."""
    if ACTIVATION == "silu":
        return x / (1.0 + tl.exp(-x))
    elif ACTIVATION == "gelu":
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        tl.static_assert(ACTIVATION == "gelu_tanh", "ACTIVATION must be silu, gelu or gelu_tanh")
        return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
