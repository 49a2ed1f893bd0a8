"""Fused elementwise kernels of the Llama layer, each computing in fp32 and storing in the tensor's dtype:

    rms_norm(x, w)                  y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)            grid = (T,)
    fused_add_rms_norm(x, r, w)     r = x + r (in place); x = rms_norm(r, w) (in place)       grid = (T,)
    rotary_neox(pos, q, k, cos, sin)  in place on q [T, H, D] and k [T, Hk, D]:
                                    x1, x2 = halves; x1' = x1 cos - x2 sin; x2' = x2 cos + x1 sin
                                    grid = (T,), one program rotates every head of one token
    silu_and_mul(x)                 x [T, 2I] = gate | up -> silu(gate) * up [T, I]            grid = (T, cdiv(I, BLOCK))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,          # [T, N] input; the normalized output when IN_PLACE (fused add)
    res_ptr,        # [T, N] residual: becomes x + residual (HAS_RESIDUAL)
    out_ptr,        # [T, N] output (not HAS_RESIDUAL)
    w_ptr,          # [N] weight
    stride_x, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    # fp32 math, rounded to the input dtype where torch rounds: after the add, after normalizing, at the end
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h = h + tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        h = h.to(dtype)
        tl.store(res_ptr + row * stride_r + offs, h, mask=ok)
        h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = (h * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, N], weight [N]. Without residual -> new y [T, N]. With residual [T, N]: residual += x and
    x = rms_norm(residual) both in place; returns (x, residual)."""
    t, n = x.shape
    if weight.shape != (n,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or (residual is not None and (residual.stride(-1) != 1 or residual.dtype != x.dtype)):
        raise ValueError("x/residual need a contiguous last dim and the same dtype")
    out = x if residual is not None else torch.empty_like(x)
    if t:
        rms_norm_kernel[(t,)](x, residual if residual is not None else x, out, weight, x.stride(0),
                              residual.stride(0) if residual is not None else 0, out.stride(0), eps,
                              N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None)
    return out if residual is None else (out, residual)


@triton.jit
def rotary_neox_kernel(
    positions_ptr,  # [T] int64 position of each token
    q_ptr,          # [T, H, D] queries, rotated in place
    k_ptr,          # [T, Hk, D] keys, rotated in place
    cos_ptr,        # [max_positions, D] cos table (both halves equal)
    sin_ptr,        # [max_positions, D] sin table
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_P)
    d_ok = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    offs_h = tl.arange(0, HEADS_P)
    for which in tl.static_range(2):
        if which == 0:
            ptr = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
            mask = (offs_h < NUM_HEADS)[:, None] & d_ok[None, :]
        else:
            ptr = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
            mask = (offs_h < NUM_KV_HEADS)[:, None] & d_ok[None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
        y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
        y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
        tl.store(ptr, y1.to(x1.dtype), mask=mask)
        tl.store(ptr + HALF, y2.to(x1.dtype), mask=mask)


def rotary_neox(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64, q [T, H, D], k [T, Hk, D] (views with contiguous last dim), cos/sin [P, D]."""
    t, h, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or positions.shape != (t,) or cos.shape[1] != d or sin.shape != cos.shape:
        raise ValueError(f"shapes: positions {tuple(positions.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)}")
    if d % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or positions.dtype != torch.int64:
        raise ValueError("need an even head dim, contiguous last dims and int64 positions")
    if t:
        rotary_neox_kernel[(t,)](positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                 cos.stride(0), NUM_HEADS=h, NUM_KV_HEADS=k.shape[1],
                                 HEADS_P=triton.next_power_of_2(max(h, k.shape[1])), HALF=d // 2,
                                 HALF_P=triton.next_power_of_2(d // 2))
    return q, k


@triton.jit
def silu_and_mul_kernel(
    x_ptr,      # [T, 2 * I] gate then up
    out_ptr,    # [T, I]
    stride_x, stride_o,
    I: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    t, two_i = x.shape
    if two_i % 2 or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} needs an even last dim, contiguous")
    i = two_i // 2
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    if t:
        block = min(SILU_BLOCK, triton.next_power_of_2(i))
        silu_and_mul_kernel[(t, triton.cdiv(i, block))](x, out, x.stride(0), out.stride(0), I=i, BLOCK=block)
    return out
