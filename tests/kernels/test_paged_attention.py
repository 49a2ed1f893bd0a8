"""The unified paged-attention kernel against the slow reference, on random batches (see attention_cases)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from steploop.gpu_worker.kernels.paged_attention import (
    choose_num_splits,
    kv_token_offsets,
    plan_attention,
    unified_attention,
)
from steploop.gpu_worker.kernels.reference import paged_attention_ref, write_kv_cache_ref
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import INTERPRETED, assert_close

# (query_lens, cached tokens before this step); block size 16
CASES = {
    "mixed": ([5, 1, 19, 1], [0, 31, 13, 16]),           # chunk from 0, decode, chunk crossing blocks, decode
    "one_token": ([1], [0]),
    "decode_at_block_edges": ([1, 1, 1, 1], [14, 15, 16, 31]),
    "odd_chunks": ([7, 3, 33], [9, 0, 17]),
    "long_context": ([1, 6], [300, 181]),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_kernel(case, num_splits: int | None, device) -> torch.Tensor:
    c = case.common
    write_kv_cache_ref(case.k, case.v, case.kv_cache, c.slot_mapping)
    plan = plan_attention(c.query_start_loc, c.seq_lens, c.block_tables, c.query_lens_cpu, c.seq_lens_cpu,
                          case.q.shape[1], case.kv_cache.shape[3], num_splits)
    out = torch.empty_like(case.q)
    return unified_attention(case.q, case.kv_cache, out, plan, case.q.shape[-1] ** -0.5)


def reference(case) -> torch.Tensor:
    return paged_attention_ref(case.q.float(), case.kv_cache.float(), case.query_lens, case.seq_lens,
                               case.block_tables, case.q.shape[-1] ** -0.5)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cases_fp32(name, num_splits, device):
    case = make_case(*CASES[name], device=device, seed=hash(name) % 1000)
    assert_close(run_kernel(case, num_splits, device), reference(case), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_dtypes_and_head_sizes(dtype, head_dim, num_splits, device):
    """bf16 under the interpreter runs the kernel's fp32-upcast dot path (DOT_FP32): the interpreter's bf16
    tl.dot is wrong; the native bf16 dot is covered when this runs compiled on a GPU."""
    case = make_case([4, 1, 1], [13, 16, 40], heads=(8, 2), head_dim=head_dim, dtype=dtype, device=device)
    assert_close(run_kernel(case, num_splits, device), reference(case), dtype)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
def test_gqa_groups(heads, device):
    """QPK of 3 (padded to 4), 1 (multi-head) and 8 (multi-query)."""
    case = make_case([3, 1], [5, 20], heads=heads, device=device)
    assert_close(run_kernel(case, None, device), reference(case), torch.float32)


def test_shared_prefix_blocks(device):
    """Two requests whose tables point at the same first two blocks (a prefix-cache hit): the second request's
    new tokens go after the shared blocks and both read the shared context."""
    case = make_case([3, 2], [32, 35], share_prefix_blocks=2, device=device)
    assert (case.block_tables[0, :2] == case.block_tables[1, :2]).all()
    assert_close(run_kernel(case, 1, device), reference(case), torch.float32)


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size, device):
    case = make_case([5, 1], [11, 40], block_size=block_size, device=device)
    assert_close(run_kernel(case, 2, device), reference(case), torch.float32)


def test_split_count_heuristic():
    assert choose_num_splits(num_programs=192, max_seq_len=2048, max_query_len=1, num_sms=132) == 1   # full GPU
    assert choose_num_splits(num_programs=3, max_seq_len=2048, max_query_len=1, num_sms=132) == 8    # by length
    assert choose_num_splits(num_programs=3, max_seq_len=100_000, max_query_len=1, num_sms=132) == 16
    assert choose_num_splits(num_programs=3, max_seq_len=200, max_query_len=1, num_sms=132) == 1     # short
    assert choose_num_splits(num_programs=3, max_seq_len=8192, max_query_len=7, num_sms=132) == 1    # prefill


def test_plan_tiles():
    ql = np.array([5, 1, 19], np.int32)
    z = torch.zeros(3, dtype=torch.int32)
    plan = plan_attention(torch.zeros(4, dtype=torch.int32), z, z[:, None], ql, ql, 9, 3, num_splits=1)
    assert plan.block_q == 16                                  # 64 rows / QPK_P 4
    assert plan.tile_req.tolist() == [0, 1, 2, 2] and plan.tile_qstart.tolist() == [0, 0, 0, 16]
    decode = plan_attention(torch.zeros(4, dtype=torch.int32), z, z[:, None], np.ones(3, np.int32), ql, 9, 3)
    assert decode.block_q == 4 and decode.tile_req.tolist() == [0, 1, 2]


def test_launcher_rejects_bad_inputs(device):
    case = make_case([2], [3], device=device)
    c = case.common
    plan = plan_attention(c.query_start_loc, c.seq_lens, c.block_tables, c.query_lens_cpu, c.seq_lens_cpu, 4, 2)
    with pytest.raises(ValueError, match="dtypes"):
        unified_attention(case.q.half(), case.kv_cache, torch.empty_like(case.q.half()), plan, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        unified_attention(case.q[:, :3], case.kv_cache, torch.empty_like(case.q[:, :3]), plan, 1.0)


@triton.jit
def _probe_offsets(table_ptr, out_ptr, stride_bt, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr, N: tl.constexpr):
    """out[p] = the cache offset of position p of request 0 (program 0)."""
    pos = tl.arange(0, N)
    off = kv_token_offsets(table_ptr, tl.program_id(0), pos, stride_bt, stride_cb, stride_cs, BLOCK_SIZE, pos < N)
    tl.store(out_ptr + pos, off)


@pytest.mark.skipif(not INTERPRETED, reason="the offset helper is checked once, under the interpreter")
def test_offsets_are_int64():
    """Block id * block stride past 2**31 elements (a >4 GB fp16 cache) must not wrap. A real cache that big
    does not fit here, so check the offset helper the kernel uses directly: block 2**21 with a 16 x 8 x 128
    block (2**14 elements) is element 2**35. Under the interpreter int32 math wraps like on a GPU."""
    table = torch.tensor([0, 2**21, 2**21 + 7, 0], dtype=torch.int32)   # [2, 2]: row 0 = blocks 0, 2**21
    out = torch.zeros(32, dtype=torch.int64)
    stride_cb, stride_cs = 16 * 8 * 128, 8 * 128
    _probe_offsets[(1,)](table, out, 2, stride_cb, stride_cs, BLOCK_SIZE=16, N=32)
    expected = [int(table[p // 16]) * stride_cb + (p % 16) * stride_cs for p in range(32)]
    assert out.tolist() == expected and max(expected) > 2**31
