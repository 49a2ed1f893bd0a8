"""W4A16 GEMM: y = x @ W^T with W int4 groups read as stored, dequantized tile by tile in registers:

    W[n, k] = scale[k // GROUP, n] * (q[n, k] - zero[k // GROUP, n])

the common form of GPTQ, AWQ and compressed-tensors int4 (model/quant/formats.py); act-order weights arrive with K
already permuted so groups are contiguous (model/quant/packing.py) and the caller permutes x the same way.

    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); each program runs the whole K for one [BLOCK_M, BLOCK_N] tile

The dequantized tile is cast to x's dtype for tl.dot (bf16/fp16 on a GPU, accumulating in fp32), or kept fp32 with
IEEE products (DOT_FP32: fp32 inputs and the interpreter, where bf16 dots are not exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from steploop.gpu_worker.model.quant.formats import IntWeight


@triton.jit
def w4a16_kernel(
    x_ptr,          # [M, K] activations (contiguous)
    qweight_ptr,    # [K / 8, N] int32: value k % 8 of word k // 8 at bits 4 * (k % 8) (GPTQ's qweight layout)
    scale_ptr,      # [K / GROUP, N] fp32
    zero_ptr,       # [K / GROUP, N] fp32 (integer values)
    y_ptr,          # [M, N] output, x's dtype (contiguous)
    M, N, K,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                           # [BM, BK]
        wk = k_ok[:, None] & n_ok[None, :]
        words = tl.load(qweight_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :], mask=wk, other=0)
        q = ((words >> ((offs_k % 8) * 4)[:, None]) & 15).to(tl.float32)                 # [BK, BN]
        at = (offs_k // GROUP)[:, None].to(tl.int64) * N + offs_n[None, :]
        scale = tl.load(scale_ptr + at, mask=wk, other=0.0)
        zero = tl.load(zero_ptr + at, mask=wk, other=0.0)
        w = scale * (q - zero)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w4a16_constexprs(m: int, group: int, dtype: torch.dtype, interpret: bool) -> dict:
    """BLOCK_M 16 for decode-sized batches, 64 for prompt chunks; BLOCK_K 32 divides every supported group."""
    return {"GROUP": group, "BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64, "BLOCK_K": 32,
            "DOT_FP32": dtype == torch.float32 or interpret}


class Int4Gpu:
    """An int4 IntWeight in the kernel's layout: qweight [K/8, N] int32, scale and zero [G, N] fp32."""

    def __init__(self, w: IntWeight):
        if w.bits != 4 or w.g_idx is not None or w.q.shape[1] % 8:
            raise ValueError("w4a16 takes int4 weights with contiguous groups and K % 8 == 0")
        n, k = w.q.shape
        codes = w.q.T.contiguous().view(k // 8, 8, n).to(torch.int64)
        words = sum(codes[:, j] << (4 * j) for j in range(8))
        self.qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
        self.scale, self.zero = w.scale.T.float().contiguous(), w.zero.T.float().contiguous()
        self.group, self.out_features, self.in_features = w.group_size, n, k

    def to(self, device: torch.device) -> Int4Gpu:
        for name in ("qweight", "scale", "zero"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.zero))


def w4a16_linear(x: torch.Tensor, w: Int4Gpu, interpret: bool = False) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) -> [M, N] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"w4a16_linear: x {tuple(x.shape)} for a [{w.out_features}, {w.in_features}] weight")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=x.dtype, device=x.device)
    c = w4a16_constexprs(m, w.group, x.dtype, interpret)
    grid = (triton.cdiv(m, c["BLOCK_M"]), triton.cdiv(w.out_features, c["BLOCK_N"]))
    w4a16_kernel[grid](x, w.qweight, w.scale, w.zero, y, m, w.out_features, w.in_features, **c)
    return y


def w4a16_reference(x: torch.Tensor, w: Int4Gpu) -> torch.Tensor:
    """The slow obvious version: dequantize all of W in fp32, one matmul."""
    k = w.in_features
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=x.device)
    q = ((w.qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(k, -1).float()      # [K, N]
    g = torch.arange(k, device=x.device) // w.group
    weight = w.scale[g] * (q - w.zero[g])                                                   # [K, N]
    return (x.float() @ weight).to(x.dtype)
