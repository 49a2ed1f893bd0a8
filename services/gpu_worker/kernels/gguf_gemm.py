"""GGUF block-quantized GEMM: y = x @ W^T with W held as a GGUF file's integer values and per-block fp32 scales,
dequantized tile by tile in registers (never a 16-bit copy of the weight):

    W[n, k] = d[k // BLOCK, n] * q[k, n]  (+ m[k // BLOCK, n])

the one form every block type decodes to (gguf/blocks.py): Q4_0 / Q4_1 / Q4_K as nibbles (0..15; Q4_0's -8 and the
k-quants' mins folded into m), Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 as int8, BLOCK 32 (16 for Q6_K). d * q is exact in
fp32 and m added once, as gguf-py's dequantize rounds.

    q      [K / 2, N] uint8 (NIBBLES: k = 2j in the low nibble of row j, 2j + 1 in the high one) or [K, N] int8
    d, m   [K / BLOCK, N] fp32
    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); each program runs the whole K for one [BLOCK_M, BLOCK_N] tile

The dequantized tile is cast to x's dtype for tl.dot (bf16/fp16 on a GPU, fp32 accumulation), or kept fp32 with IEEE
products (DOT_FP32: fp32 inputs, and the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gguf_gemm_kernel(
    x_ptr,          # [M, K] activations (contiguous)
    q_ptr,          # [K / 2, N] uint8 nibbles or [K, N] int8
    d_ptr,          # [K / BLOCK, N] fp32
    m_ptr,          # [K / BLOCK, N] fp32 (read only with HAS_M)
    y_ptr,          # [M, N] output, x's dtype (contiguous)
    M, N, K,
    BLOCK: tl.constexpr, NIBBLES: tl.constexpr, HAS_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
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
        if NIBBLES:
            byte = tl.load(q_ptr + (offs_k // 2)[:, None].to(tl.int64) * N + offs_n[None, :], mask=wk, other=0)
            q = ((byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 15).to(tl.float32)   # [BK, BN]
        else:
            q = tl.load(q_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :], mask=wk, other=0).to(tl.float32)
        at = (offs_k // BLOCK)[:, None].to(tl.int64) * N + offs_n[None, :]
        w = tl.load(d_ptr + at, mask=wk, other=0.0) * q
        if HAS_M:
            w = w + tl.load(m_ptr + at, mask=wk, other=0.0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gguf_gemm_constexprs(m: int, block: int, nibbles: bool, has_m: bool, dtype: torch.dtype,
                         interpret: bool) -> dict:
    """BLOCK_M 16 for decode-sized batches, 64 for prompt chunks; BLOCK_K 32 holds whole 16- and 32-weight blocks.
    The interpreter runs few large tiles instead (its cost is per program and step, not per element)."""
    if interpret:
        return {"BLOCK": block, "NIBBLES": nibbles, "HAS_M": has_m, "BLOCK_M": 64, "BLOCK_N": 512, "BLOCK_K": 128,
                "DOT_FP32": True}
    return {"BLOCK": block, "NIBBLES": nibbles, "HAS_M": has_m, "BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64,
            "BLOCK_K": 32, "DOT_FP32": dtype == torch.float32}


def gguf_gemm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, block: int) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype; q, d, m as the kernel holds them (GgufBlocks, gguf/triton_linear.py)."""
    nibbles = q.dtype == torch.uint8
    k = q.shape[0] * (2 if nibbles else 1)
    n = q.shape[1]
    if x.shape[-1] != k or d.shape != (k // block, n) or (m is not None and m.shape != d.shape):
        raise ValueError(f"gguf_gemm: x {tuple(x.shape)}, q {tuple(q.shape)} {q.dtype}, d {tuple(d.shape)}, "
                         f"block {block}")
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    c = gguf_gemm_constexprs(rows, block, nibbles, m is not None, x.dtype, triton.knobs.runtime.interpret)
    grid = (triton.cdiv(rows, c["BLOCK_M"]), triton.cdiv(n, c["BLOCK_N"]))
    gguf_gemm_kernel[grid](x, q, d, d if m is None else m, y, rows, n, k, **c)
    return y
