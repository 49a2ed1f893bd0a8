"""ctypes front end of paged_attention.c: fused paged decode attention on the CPU (fp32), see the C file's header.

    if available() and supports(num_heads, num_kv_heads, head_dim):   # available() builds/loads it on first call
        paged_attention(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale, num_threads)
        paged_attention(..., isa="avx2")      # another build's kernel (build.py ISAS; tests)

Tensors go in as data pointers, so the wrapper checks what the C code assumes: CPU, contiguous, the dtypes below.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from steploop.gpu_worker.cpu_kernels.build import function

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _kernel(isa: str | None = None):
    return function("steploop_paged_attention", [_PTR] * 6 + [_I64] * 8 + [ctypes.c_float, ctypes.c_int],
                    isa=isa)


def available() -> bool:
    return _kernel() is not None


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """The C file's limits: head_dim <= MAX_D, G = H / Hk <= MAX_H, G * head_dim <= MAX_HD (its stack buffers)."""
    group = num_heads // num_kv_heads
    return head_dim <= 256 and group <= 256 and group * head_dim <= 8192


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or t.dim() != dim or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous {dim}-d {dtype} CPU tensor, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})")


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_threads: int,
                    isa: str | None = None) -> None:
    """out, q [T, H, D] fp32; kv_cache [2, num_blocks, block_size, Hk, D] fp32; block_tables [R, max_blocks],
    query_start_loc [R + 1], seq_lens [R] int32. Writes out in place."""
    f32, i32 = torch.float32, torch.int32
    for name, t, dtype, dim in (("out", out, f32, 3), ("q", q, f32, 3), ("kv_cache", kv_cache, f32, 5),
                                ("block_tables", block_tables, i32, 2), ("query_start_loc", query_start_loc, i32, 1),
                                ("seq_lens", seq_lens, i32, 1)):
        _check(name, t, dtype, dim)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    if out.shape != q.shape or q.shape[2] != head_dim or kv_cache.shape[0] != 2 \
            or query_start_loc.shape[0] != num_reqs + 1 or block_tables.shape[0] != num_reqs:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, out {tuple(out.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, block_tables {tuple(block_tables.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)}, seq_lens {tuple(seq_lens.shape)}")
    kernel = _kernel(isa)
    if kernel is None:
        raise RuntimeError("the CPU paged attention library is not available (see build.py's warning)")
    rc = kernel(
        out.data_ptr(), q.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), query_start_loc.data_ptr(),
        seq_lens.data_ptr(), q.shape[0], num_reqs, q.shape[1], num_kv_heads, head_dim, num_blocks, block_size,
        block_tables.shape[1], scale, num_threads)
    if rc:
        raise ValueError("paged_attention: bad arguments (head counts, head_dim > 256, more than 256 query heads per "
                         "KV head, query_start_loc past q's rows, a seq_len shorter than its query_len, or a block "
                         "id out of range)")
