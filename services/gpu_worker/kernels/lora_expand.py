"""LoRA expand, in place: y[token_indices[i], n_offset:n_offset + N] += z[i] @ B[slot]^T.

n_offset lets a fused output (qkv, gate_up) take each slice's adapter in its own launch. Each program adds a
[BLOCK_M, BLOCK_N] tile; the rank is the dot's reduction, all of it in one step (BLOCK_R >= rank):

    grid = (segments, cdiv(max_seg_len, BLOCK_M), cdiv(N, BLOCK_N))

Rows of token_indices are distinct, so programs never write the same element: no atomics. The sum is formed in
fp32 and rounded once to y's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from steploop.gpu_worker.kernels import lora_meta
from steploop.gpu_worker.kernels.lora_rows import segment_rows
from steploop.gpu_worker.lora.segments import LoraSegments


@triton.jit
def lora_expand_kernel(
    z_ptr,                  # [T', R] shrink output, fp32 or y's dtype (row stride given; last dim contiguous)
    b_ptr,                  # [L, N, R] stacked B matrices (contiguous)
    y_ptr,                  # [T, N_total] output rows, updated in place (row stride given; last dim contiguous)
    token_indices_ptr,      # [T'] int64 row of y for each row of z
    seg_starts_ptr,         # [S] int32 first row of z of each segment
    seg_lens_ptr,           # [S] int32 rows of each segment
    seg_slots_ptr,          # [S] int32 adapter slot of each segment
    n_out, rank, n_offset,  # N, R, first column of y this slice writes
    stride_zt, stride_yt, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_FP32: tl.constexpr,       # dot in fp32 (fp32 weights; bf16 under the interpreter), else in B's dtype
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
):
    seg = tl.program_id(0)
    m_tile = tl.program_id(1)
    n_tile = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if m_tile * BLOCK_M < seg_len:
        seg_start, slot, offs_m, m_ok, rows = segment_rows(token_indices_ptr, seg_starts_ptr, seg_slots_ptr, seg,
                                                           m_tile, seg_len, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        z_rows = (seg_start + offs_m).to(tl.int64) * stride_zt
        zb = tl.load(z_ptr + z_rows[:, None] + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        b_cols = b_ptr + slot * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn                # [1, N]
        bb = tl.load(b_cols + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)      # [R, N]
        if DOT_FP32:
            zb = zb.to(tl.float32)
            bb = bb.to(tl.float32)
        else:
            zb = zb.to(bb.dtype)
        delta = tl.dot(zb, bb, input_precision=DOT_PRECISION)                                    # [M, N] fp32
        y_tile = y_ptr + rows[:, None] * stride_yt + (n_offset + offs_n)[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        y = tl.load(y_tile, mask=mask, other=0.0)
        tl.store(y_tile, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def expand_constexprs(max_seg_len: int, rank: int, dtype: torch.dtype, interpret: bool) -> dict:
    """The kernel's compile-time configuration for one launch (also used by the ahead-of-time compile test)."""
    return {"BLOCK_M": lora_meta.block_m(max_seg_len), "BLOCK_N": lora_meta.EXPAND_BLOCK_N,
            "BLOCK_R": lora_meta.block_r(rank), **lora_meta.dot_constexprs(dtype, interpret)}


def lora_expand_triton(y: torch.Tensor, z: torch.Tensor, lora_b: torch.Tensor, seg: LoraSegments,
                       n_offset: int = 0) -> None:
    """y [T, N_total] (last dim contiguous) += on columns [n_offset, n_offset + N): z [T', R] (fp32 or y's dtype,
    last dim contiguous; a column slice of a wider shrink output is fine) @ lora_b [L, N, R]^T. One launch."""
    lora_meta.check_expand(y, z, lora_b, seg, n_offset)
    t = y.shape[0]
    num_slots, n, rank = lora_b.shape
    if y.stride(-1) != 1 or z.stride(-1) != 1 or not lora_b.is_contiguous():
        raise ValueError("y and z need a contiguous last dim; lora_b must be contiguous")
    lora_meta.check_segments(seg, t, num_slots, y.device)
    c = expand_constexprs(seg.max_seg_len, rank, y.dtype, lora_meta.interpreting())
    lora_expand_kernel[lora_meta.grid(seg, c["BLOCK_M"], triton.cdiv(n, c["BLOCK_N"]))](
        z, lora_b, y, seg.token_indices, seg.seg_starts, seg.seg_lens, seg.seg_slots, n, rank, n_offset,
        z.stride(0), y.stride(0), lora_b.stride(0), lora_b.stride(1), **c)
