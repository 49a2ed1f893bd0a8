"""FP8 W8A8 GEMM (compressed-tensors float-quantized): y = (x_q @ w_q^T) * x_scale[m] * w_scale[n], x_q the
activations quantized to e4m3 per token (model/quant/linear.py's quantize_fp8_per_token), w_q the stored e4m3
weights with per-tensor (broadcast to every row) or per-channel scales.

    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); each program runs the whole K for one tile, accumulating in fp32

e4m3 operands arrive as their bytes (uint8 views). NATIVE_FP8 (sm_89 and later) bitcasts them to float8e4nv for the
tensor cores; otherwise each byte is decoded exactly (sign, 4-bit exponent, 3-bit mantissa) to fp16 for the dot
(sm_80), or fp32 with IEEE products (the interpreter): e4m3 products are exact in either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from steploop.gpu_worker.kernels.fp8_bytes import e4m3_to_fp32


@triton.jit
def fp8_w8a8_kernel(
    xq_ptr,      # [M, K] uint8: e4m3 activation bytes (contiguous)
    xs_ptr,      # [M] fp32 per-token activation scales
    wq_ptr,      # [N, K] uint8: e4m3 weight bytes (contiguous)
    ws_ptr,      # [N] fp32 per-channel weight scales (a per-tensor scale repeated)
    y_ptr,       # [M, N] output (contiguous)
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NATIVE_FP8: tl.constexpr, DOT_FP16: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xb = tl.load(xq_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0)
        wb = tl.load(wq_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                     other=0)                                                                  # [BK, BN]
        if NATIVE_FP8:
            acc = tl.dot(xb.to(tl.float8e4nv, bitcast=True), wb.to(tl.float8e4nv, bitcast=True), acc)
        elif DOT_FP16:
            acc = tl.dot(e4m3_to_fp32(xb).to(tl.float16), e4m3_to_fp32(wb).to(tl.float16), acc)
        else:
            acc = tl.dot(e4m3_to_fp32(xb), e4m3_to_fp32(wb), acc, input_precision="ieee")
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_constexprs(m: int, native_fp8: bool, interpret: bool) -> dict:
    return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64, "BLOCK_K": 64,
            "NATIVE_FP8": native_fp8 and not interpret, "DOT_FP16": not interpret}


def native_fp8(device: torch.device) -> bool:
    """Tensor-core e4m3 dots: sm_89 (Ada) and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_w8a8_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, interpret: bool = False) -> torch.Tensor:
    """xq [M, K] e4m3, x_scale [M, 1] fp32, wq [N, K] e4m3, w_scale [N, 1] or [1, 1] fp32 -> [M, N] out_dtype."""
    m, k = xq.shape
    n = wq.shape[0]
    if wq.shape[1] != k or xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_w8a8_linear: x {tuple(xq.shape)} {xq.dtype}, w {tuple(wq.shape)} {wq.dtype}")
    ws = w_scale.float().reshape(-1).expand(n).contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    c = fp8_constexprs(m, native_fp8(xq.device), interpret)
    grid = (triton.cdiv(m, c["BLOCK_M"]), triton.cdiv(n, c["BLOCK_N"]))
    fp8_w8a8_kernel[grid](xq.contiguous().view(torch.uint8), x_scale.float().reshape(-1).contiguous(),
                          wq.contiguous().view(torch.uint8), ws, y, m, n, k, **c)
    return y


def fp8_w8a8_reference(xq, x_scale, wq, w_scale, out_dtype):
    return ((xq.float() @ wq.float().T) * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
            ).to(out_dtype)
