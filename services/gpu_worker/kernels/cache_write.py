"""Write the step's new K and V into one layer's paged cache, token by token, at slot_mapping.

slot s means block s // block_size, row s % block_size; slot -1 is padding (a CUDA-graph pad token) and is
skipped. One program per token writes all of its KV heads:

    grid = (T,)

An FP8 cache (kv_cache_dtype.py) gets K / scale and V / scale rounded to its format by torch first (the conversion
instructions are sm_89+, torch's works everywhere), then the kernel copies their bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from steploop.gpu_worker import kv_cache_dtype


@triton.jit
def cache_write_kernel(
    k_ptr,              # [T, Hk, D] new keys (row strides given; last dim contiguous)
    v_ptr,              # [T, Hk, D] new values
    k_cache_ptr,        # [num_blocks, block_size, Hk, D] (kv_cache[0], contiguous)
    v_cache_ptr,        # [num_blocks, block_size, Hk, D] (kv_cache[1])
    slot_mapping_ptr,   # [T] int64 slot of each token, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, HEADS_P)
        offs_d = tl.arange(0, HEAD_DIM_P)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + offs_h[:, None] * stride_ch + offs_d[None, :]                      # [HEADS_P, HEAD_DIM_P] int64
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def cache_write_constexprs(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    return {"NUM_KV_HEADS": num_kv_heads, "HEADS_P": triton.next_power_of_2(num_kv_heads), "HEAD_DIM": head_dim,
                "HEAD_DIM_P": triton.next_power_of_2(head_dim), "BLOCK_SIZE": block_size}


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """k/v [T, Hk, D] (views with a contiguous last dim are fine), kv_cache [2, num_blocks, block_size, Hk, D]
    contiguous, slot_mapping [T] int64 (-1 = skip). scales: (k_scale, v_scale) one-element fp32 tensors, for an
    FP8 cache only."""
    t, hk, d = k.shape
    if v.shape != k.shape or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (hk, d) \
            or slot_mapping.shape != (t,):
        raise ValueError(f"shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, kv_cache {tuple(kv_cache.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64 or k.dtype != v.dtype:
        raise ValueError(f"dtypes: slot_mapping {slot_mapping.dtype} (want int64), k {k.dtype}, v {v.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not kv_cache.is_contiguous() \
            or not slot_mapping.is_contiguous():
        raise ValueError("k/v need a contiguous last dim; kv_cache and slot_mapping must be contiguous")
    if kv_cache_dtype.is_fp8(kv_cache.dtype) != (scales is not None):
        raise ValueError(f"a {kv_cache.dtype} cache {'needs' if scales is None else 'takes no'} K/V scales")
    if t == 0:
        return
    if scales is not None:
        k = kv_cache_dtype.quantize(k, scales[0], kv_cache.dtype).view(torch.uint8)
        v = kv_cache_dtype.quantize(v, scales[1], kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    cache_write_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                             v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                             **cache_write_constexprs(hk, d, kv_cache.shape[2]))
