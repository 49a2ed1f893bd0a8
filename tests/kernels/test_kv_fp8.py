"""An FP8 KV cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2) in the Triton kernels: the byte decoders exact over
every finite byte, the cache write equal to torch's rounding of x / scale, and the attention kernel equal to the
torch reference attending over the dequantized cache (plain, split-KV, windowed + soft-capped, GQA, bf16 queries)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from steploop.gpu_worker import kv_cache_dtype
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.kernels.cache_write import write_kv_cache
from steploop.gpu_worker.kernels.fp8_bytes import e4m3_to_fp32, e5m2_to_fp32
from steploop.gpu_worker.kernels.paged_attention import plan_attention, unified_attention
from steploop.gpu_worker.kernels.reference import paged_attention_ref, write_kv_cache_ref
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import assert_close

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@triton.jit
def _decode_kernel(src_ptr, dst_ptr, E5M2: tl.constexpr):
    offs = tl.arange(0, 256)
    b = tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs, e5m2_to_fp32(b) if E5M2 else e4m3_to_fp32(b))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_decoders_are_exact_for_every_finite_byte(dtype, device):
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = raw.view(dtype).float()
    got = torch.empty(256, dtype=torch.float32, device=device)
    _decode_kernel[(1,)](raw.to(device), got, E5M2=dtype == torch.float8_e5m2)
    finite = torch.isfinite(want)
    assert finite.sum() >= 248                                    # e5m2: all but +-inf and 6 NaNs
    assert torch.equal(got.cpu()[finite], want[finite])


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_cache_write_stores_x_over_scale_rounded(dtype, device):
    gen = torch.Generator().manual_seed(3)
    t, hk, d, num_blocks, bs = 9, 2, 64, 5, 16
    k, v = (torch.randn((t, hk, d), generator=gen) * 300 for _ in range(2))   # some beyond e4m3's 448 at scale 1
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[4] = -1
    scales = (torch.tensor([0.5]), torch.tensor([2.0]))
    cache = torch.zeros((2, num_blocks, bs, hk, d), dtype=dtype)
    want = cache.clone()
    write_kv_cache_ref(kv_cache_dtype.quantize(k, scales[0], dtype), kv_cache_dtype.quantize(v, scales[1], dtype),
                       want, slots)
    cache = cache.to(device)
    write_kv_cache(k.to(device), v.to(device), cache, slots.to(device), tuple(s.to(device) for s in scales))
    assert torch.equal(cache.cpu().view(torch.uint8), want.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()                    # clamped to the format's range, never inf / NaN


def test_cache_write_needs_scales_exactly_for_fp8(device):
    k = torch.zeros((2, 1, 64), device=device)
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    one = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="needs K/V scales"):
        write_kv_cache(k, k, torch.zeros((2, 2, 16, 1, 64), dtype=torch.float8_e4m3fn, device=device), slots)
    with pytest.raises(ValueError, match="takes no"):
        write_kv_cache(k, k, torch.zeros((2, 2, 16, 1, 64), device=device), slots, (one, one))


def _fp8_case(dtype, q_dtype, device, **kw):
    case = make_case([5, 1, 19, 1], [0, 31, 13, 40], device=device, **kw)
    scales = (torch.tensor([0.75], device=device), torch.tensor([1.5], device=device))
    cache = torch.stack([kv_cache_dtype.quantize(case.kv_cache[i], scales[i], dtype) for i in range(2)])
    dequantized = torch.stack([kv_cache_dtype.dequantize(cache[i], scales[i]) for i in range(2)])
    return case, case.q.to(q_dtype), cache, dequantized, scales


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_reads_the_dequantized_cache(dtype, num_splits, q_dtype, device):
    case, q, cache, dequantized, scales = _fp8_case(dtype, q_dtype, device, heads=(8, 2))
    c = case.common
    plan = plan_attention(c.query_start_loc, c.seq_lens, c.block_tables, c.query_lens_cpu, c.seq_lens_cpu, 8, 2,
                          num_splits)
    got = unified_attention(q, cache, torch.empty_like(q), plan, 0.125, kv_scales=scales)
    want = paged_attention_ref(q.float(), dequantized, case.query_lens, case.seq_lens, case.block_tables, 0.125)
    assert_close(got.float(), want, q_dtype)


def test_attention_fp8_with_window_and_softcap(device):
    case, q, cache, dequantized, scales = _fp8_case(torch.float8_e4m3fn, torch.float32, device)
    c = case.common
    plan = plan_attention(c.query_start_loc, c.seq_lens, c.block_tables, c.query_lens_cpu, c.seq_lens_cpu, 4, 2, 1)
    got = unified_attention(q, cache, torch.empty_like(q), plan, 0.125, 16, 30.0, scales)
    want = paged_attention_ref(q, dequantized, case.query_lens, case.seq_lens, case.block_tables, 0.125, 16, 30.0)
    assert_close(got, want, torch.float32)


def test_attention_refuses_missing_or_stray_scales(device):
    case, q, cache, _, scales = _fp8_case(torch.float8_e4m3fn, torch.float32, device)
    c = case.common
    plan = plan_attention(c.query_start_loc, c.seq_lens, c.block_tables, c.query_lens_cpu, c.seq_lens_cpu, 4, 2, 1)
    with pytest.raises(ValueError, match="scales"):
        unified_attention(q, cache, torch.empty_like(q), plan, 0.125)
    with pytest.raises(ValueError, match="no scales"):
        unified_attention(q, case.kv_cache, torch.empty_like(q), plan, 0.125, kv_scales=scales)


def test_backend_writes_then_reads_fp8_as_the_reference(device):
    """The Triton backend's forward (write the step's K/V, then attend) on an FP8 cache equals the torch backend on
    an fp32 cache holding the same dequantized values, the step's new K/V rounded the same way."""
    case, q, cache, dequantized, scales = _fp8_case(torch.float8_e4m3fn, torch.float32, device)
    triton_be = create_backend("triton", 4, 2, 64, 0.125)
    triton_be.set_kv_scales({0: (0.75, 1.5)}, device)
    got = triton_be.forward(0, q, case.k, case.v, cache, triton_be.build_metadata(case.common))
    k = kv_cache_dtype.dequantize(kv_cache_dtype.quantize(case.k, scales[0], cache.dtype), scales[0])
    v = kv_cache_dtype.dequantize(kv_cache_dtype.quantize(case.v, scales[1], cache.dtype), scales[1])
    torch_be = create_backend("torch", 4, 2, 64, 0.125)
    want = torch_be.forward(0, q, k, v, dequantized, torch_be.build_metadata(case.common))
    assert_close(got, want, torch.float32)
    assert torch.equal(kv_cache_dtype.dequantize(cache[0], scales[0]), dequantized[0])   # what the reference read
    with pytest.raises(ValueError, match="set_kv_scales"):
        triton_be.forward(1, q, case.k, case.v, cache, triton_be.build_metadata(case.common))
