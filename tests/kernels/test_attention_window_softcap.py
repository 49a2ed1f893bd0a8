"""The unified paged-attention kernel's per-layer sliding window and logit soft-capping, against the slow reference,
the torch windowed-attention path the CPU serves with (model/windowed_attention.py), and transformers' own mask."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.kernels.paged_attention import plan_attention, unified_attention
from steploop.gpu_worker.kernels.reference import paged_attention_ref, write_kv_cache_ref
from steploop.gpu_worker.model.windowed_attention import WindowedAttention
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import assert_close

# (query_lens, cached tokens before this step); block size 16
WINDOW_CASES = {
    "window_inside_a_block": ([7, 1, 19], [9, 40, 13], 5),       # chunk with context, decode, chunk crossing blocks
    "window_spans_blocks": ([1, 6, 1], [300, 181, 20], 37),      # long decodes: most key tiles skipped
    "window_one": ([3, 1], [4, 17], 1),                          # each query sees only itself
    "window_wider_than_context": ([5, 1], [3, 10], 64),          # the same as full attention
}


def run_kernel(case, num_splits, window=None, softcap=None, scale=None):
    c = case.common
    write_kv_cache_ref(case.k, case.v, case.kv_cache, c.slot_mapping)
    plan = plan_attention(c.query_start_loc, c.seq_lens, c.block_tables, c.query_lens_cpu, c.seq_lens_cpu,
                          case.q.shape[1], case.kv_cache.shape[3], num_splits)
    out = torch.empty_like(case.q)
    return unified_attention(case.q, case.kv_cache, out, plan, scale or case.q.shape[-1] ** -0.5, window, softcap)


def reference(case, window=None, softcap=None, scale=None):
    return paged_attention_ref(case.q.float(), case.kv_cache.float(), case.query_lens, case.seq_lens,
                               case.block_tables, scale or case.q.shape[-1] ** -0.5, window, softcap)


@pytest.mark.parametrize("name", list(WINDOW_CASES))
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_fp32(name, num_splits, device):
    query_lens, cached, window = WINDOW_CASES[name]
    case = make_case(query_lens, cached, device=device, seed=len(name))
    got = run_kernel(case, num_splits, window)
    assert_close(got, reference(case, window), torch.float32)
    if name != "window_wider_than_context":      # the window really cut keys away
        assert not torch.allclose(got.cpu(), reference(case).float().cpu(), atol=1e-3)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_window_skips_key_tiles_before_it(num_splits, device):
    """A decode at position 300 with a 37-token window: its first key is 264, in the 64-key tile from 256. NaN in K
    and V at positions 0..255 would reach the output if any of those tiles were read (0 * NaN in the P @ V dot),
    so a finite, exact output shows the kernel reads O(window) keys, not the whole context."""
    case = make_case([1], [300], device=device)
    write_kv_cache_ref(case.k, case.v, case.kv_cache, case.common.slot_mapping)
    want = reference(case, 37)
    table = case.block_tables[0].long()
    case.kv_cache[:, table[:16]] = float("nan")              # blocks 0..15 = positions 0..255
    got = run_kernel(case, num_splits, 37)
    assert torch.isfinite(got).all()
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_window_and_softcap_dtypes_head_sizes_gqa(dtype, head_dim, device):
    """Gemma 2's local layers: both at once, GQA 4:1. bf16 under the interpreter runs the fp32-upcast dot path
    (see test_paged_attention.py)."""
    case = make_case([6, 1, 1], [13, 16, 40], heads=(8, 2), head_dim=head_dim, dtype=dtype, device=device)
    scale = 4 * head_dim ** -0.5           # logits of a few units, so a cap of 2 bends them
    got = run_kernel(case, 2, window=20, softcap=2.0, scale=scale)
    assert_close(got, reference(case, 20, 2.0, scale), dtype)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_softcap_full_attention(num_splits, device):
    case = make_case([5, 1, 19, 1], [0, 31, 13, 16], heads=(9, 3), device=device)
    scale = 0.5
    got = run_kernel(case, num_splits, softcap=3.0, scale=scale)
    assert_close(got, reference(case, softcap=3.0, scale=scale), torch.float32)
    assert not torch.allclose(got.cpu(), reference(case, scale=scale).float().cpu(), atol=1e-3)


def test_softcap_saturates_without_overflow(device):
    """Logits in the thousands: tanh saturates at +-cap (no inf / nan from exp overflow)."""
    case = make_case([4, 1], [12, 30], device=device)
    got = run_kernel(case, 1, softcap=1.5, scale=300.0)
    assert torch.isfinite(got).all()
    assert_close(got, reference(case, softcap=1.5, scale=300.0), torch.float32)


@pytest.mark.parametrize("window", [16, 17])
def test_window_boundary_matches_transformers_mask(window, device):
    """V holds each key's position and q = 0 (uniform weights), so a token's output is the mean of the positions it
    sees; the visible set must be what transformers' sliding_window_causal_mask_function allows, exactly at the edge
    (query 16 sees key 0 with window 17, not with 16)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    case = make_case([4, 1], [13, 16], head_dim=64, device=device)
    case.q.zero_()
    for r, seq_len in enumerate(case.seq_lens):
        for p in range(seq_len):
            blk, slot = int(case.block_tables[r, p // 16]), p % 16
            case.kv_cache[1, blk, slot] = float(p)
            if p >= seq_len - case.query_lens[r]:
                case.v[sum(case.query_lens[:r]) + p - (seq_len - case.query_lens[r])] = float(p)
    allowed = sliding_window_causal_mask_function(window)
    want, t = torch.empty_like(case.q), 0
    for q_len, seq_len in zip(case.query_lens, case.seq_lens):
        for p in range(seq_len - q_len, seq_len):
            keys = torch.arange(seq_len)
            seen = keys[allowed(torch.tensor(0), torch.tensor(0), torch.tensor(p), keys)]
            want[t] = seen.float().mean()
            t += 1
    assert_close(run_kernel(case, 1, window), want, torch.float32)


def test_matches_torch_windowed_attention(device):
    """The kernel against the torch path the CPU serves windowed / soft-capped layers with (exact vs transformers
    in the family tests), on the same cache and metadata."""
    case = make_case([7, 1, 19, 1], [9, 40, 13, 5], heads=(4, 2), device=device)
    torch_layer = WindowedAttention(4, 2, 64, 0.3, window=11, softcap=2.5)
    cache = case.kv_cache.clone()
    meta = type("Meta", (), {"common": case.common})()
    want = torch_layer.forward(case.q, case.k, case.v, cache, meta)
    got = run_kernel(case, 1, window=11, softcap=2.5, scale=0.3)
    assert torch.equal(cache, case.kv_cache)
    assert_close(got, want, torch.float32)


def test_launcher_rejects_bad_window_and_softcap(device):
    case = make_case([2], [3], device=device)
    with pytest.raises(ValueError, match="window"):
        run_kernel(case, 1, window=0)
    with pytest.raises(ValueError, match="softcap"):
        run_kernel(case, 1, softcap=0.0)
