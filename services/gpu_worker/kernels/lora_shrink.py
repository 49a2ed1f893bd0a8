"""LoRA shrink: z[i] = scale[slot] * x[token_indices[i]] @ A[slot]^T for every adapter row of the step.

Rows are gathered through the step's segments (one adapter slot per segment); each program computes a
[BLOCK_M, BLOCK_R] tile of z over the whole rank (BLOCK_R >= rank), reducing over its share of the hidden size:

    grid = (segments, cdiv(max_seg_len, BLOCK_M), SPLIT_K)

z is fp32 (the expand casts it to the weights' dtype for its dot). With SPLIT_K > 1 (decode-sized segments)
each split writes its partial sum to a [SPLIT_K, T', R] buffer that one torch sum reduces: no atomics, so the
result does not depend on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from steploop.gpu_worker.kernels import lora_meta
from steploop.gpu_worker.kernels.lora_rows import segment_rows
from steploop.gpu_worker.lora.segments import LoraSegments


@triton.jit
def lora_shrink_kernel(
    x_ptr,                  # [T, H] input rows (row stride given; last dim contiguous)
    a_ptr,                  # [L, R, H] stacked A matrices (contiguous)
    scale_ptr,              # [L] fp32 alpha / r of each slot
    z_ptr,                  # [SPLIT_K, T', R] fp32 output (contiguous)
    token_indices_ptr,      # [T'] int64 row of x for each row of z
    seg_starts_ptr,         # [S] int32 first row of z of each segment
    seg_lens_ptr,           # [S] int32 rows of each segment
    seg_slots_ptr,          # [S] int32 adapter slot of each segment
    hidden, rank, num_z_rows,   # H, R, T'
    stride_xt, stride_al, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,       # upcast operands to fp32 before tl.dot (fp32 inputs; bf16 under the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
):
    seg = tl.program_id(0)
    m_tile = tl.program_id(1)
    split = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if m_tile * BLOCK_M < seg_len:
        seg_start, slot, offs_m, m_ok, rows = segment_rows(token_indices_ptr, seg_starts_ptr, seg_slots_ptr, seg,
                                                           m_tile, seg_len, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        x_rows = x_ptr + rows[:, None] * stride_xt                                          # [M, 1]
        a_rows = a_ptr + slot * stride_al + offs_r[None, :].to(tl.int64) * stride_ar         # [1, R]
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        k_tiles = tl.cdiv(hidden, BLOCK_K)
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        for kt in range(split * per_split, tl.minimum((split + 1) * per_split, k_tiles)):
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            xb = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
            ab = tl.load(a_rows + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [K, R]
            if DOT_FP32:
                xb = xb.to(tl.float32)
                ab = ab.to(tl.float32)
            acc += tl.dot(xb, ab, input_precision=DOT_PRECISION)
        acc *= tl.load(scale_ptr + slot)
        z_rows = (split * num_z_rows + seg_start + offs_m).to(tl.int64) * rank
        tl.store(z_ptr + z_rows[:, None] + offs_r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


def shrink_constexprs(max_seg_len: int, hidden: int, rank: int, dtype: torch.dtype, interpret: bool) -> dict:
    """The kernel's compile-time configuration for one launch (also used by the ahead-of-time compile test)."""
    return {"BLOCK_M": lora_meta.block_m(max_seg_len), "BLOCK_R": lora_meta.block_r(rank),
            "BLOCK_K": lora_meta.SHRINK_BLOCK_K, "SPLIT_K": lora_meta.shrink_split_k(max_seg_len, hidden),
            **lora_meta.dot_constexprs(dtype, interpret)}


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, seg: LoraSegments, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H] (last dim contiguous), lora_a [L, R, H] contiguous, scale [L] fp32 -> z [T', R] fp32.
    One launch, plus one sum when the hidden reduction is split."""
    lora_meta.check_shrink(x, lora_a, scale)
    t, h = x.shape
    num_slots, rank, _ = lora_a.shape
    if x.stride(-1) != 1 or not lora_a.is_contiguous() or not scale.is_contiguous():
        raise ValueError("x needs a contiguous last dim; lora_a and scale must be contiguous")
    lora_meta.check_segments(seg, t, num_slots, x.device)
    c = shrink_constexprs(seg.max_seg_len, h, rank, x.dtype, lora_meta.interpreting())
    z = torch.empty((c["SPLIT_K"], seg.num_tokens, rank), dtype=torch.float32, device=x.device)
    lora_shrink_kernel[lora_meta.grid(seg, c["BLOCK_M"], c["SPLIT_K"])](
        x, lora_a, scale, z, seg.token_indices, seg.seg_starts, seg.seg_lens, seg.seg_slots,
        h, rank, seg.num_tokens, x.stride(0), lora_a.stride(0), lora_a.stride(1), **c)
    return z[0] if c["SPLIT_K"] == 1 else z.sum(0)
