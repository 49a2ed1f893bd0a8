"""The LoRA shrink and expand launchers (interpreted on CPU tensors, compiled on CUDA) against the row-at-a-time
torch references, across ranks, dtypes, unaligned H and N, decodes, long chunks and many mixed segments."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.kernels.lora_expand import lora_expand_triton
from steploop.gpu_worker.kernels.lora_reference import lora_delta_ref, lora_expand_ref, lora_shrink_ref
from steploop.gpu_worker.kernels.lora_shrink import lora_shrink_triton, shrink_constexprs
from tests.kernels.conftest import assert_close
from tests.kernels.lora_cases import CHUNK, DECODE, MIXED, make_case

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [8, 16, 32, 64])
def test_shrink_then_expand_matches_reference(rank, dtype, device):
    case = make_case(MIXED, hidden=40, n=72, rank=rank, dtype=dtype)          # H < BLOCK_K, N = 64 + 8
    z = lora_shrink_triton(case.to(device).x, case.to(device).lora_a, case.seg.to(device), case.scale.to(device))
    assert z.shape == (case.seg.num_tokens, rank) and z.dtype == torch.float32
    assert_close(z, lora_shrink_ref(case.x, case.lora_a, case.seg, case.scale), dtype)
    on = case.to(device)
    lora_expand_triton(on.y, z, on.lora_b, on.seg)
    expected = case.y.float() + lora_delta_ref(case.x, case.lora_a, case.lora_b, case.token_slots, case.scale)
    assert_close(on.y, expected, dtype, scale=2.0)


@pytest.mark.parametrize("token_slots,hidden", [(DECODE, 150), (CHUNK, 72), (DECODE * 3, 1100)],
                         ids=["decode", "long-chunk", "split-k"])
def test_shrink_shapes(token_slots, hidden, device):
    case = make_case(token_slots, hidden=hidden, n=16, rank=16, dtype=torch.float16)
    on = case.to(device)
    z = lora_shrink_triton(on.x, on.lora_a, on.seg, on.scale)
    assert_close(z, lora_shrink_ref(case.x, case.lora_a, case.seg, case.scale), torch.float16)


def test_split_k_is_chosen_for_decodes_on_wide_inputs():
    assert shrink_constexprs(1, 1100, 16, torch.float16, interpret=False)["SPLIT_K"] == 2
    assert shrink_constexprs(1, 4096, 16, torch.float16, interpret=False)["SPLIT_K"] == 8
    assert shrink_constexprs(512, 4096, 16, torch.float16, interpret=False)["SPLIT_K"] == 1


@pytest.mark.parametrize("token_slots", [DECODE, CHUNK], ids=["decode", "long-chunk"])
@pytest.mark.parametrize("n_offset", [0, 24])
def test_expand_into_a_slice(token_slots, n_offset, device):
    """A fused output (qkv): only columns [n_offset, n_offset + N) change; z is a column slice of a wider z."""
    case = make_case(token_slots, hidden=16, n=40, rank=8, dtype=torch.float16, n_total=96)
    wide_z = torch.randn((case.seg.num_tokens, 24), generator=torch.Generator().manual_seed(3))
    z = wide_z[:, 8:16]
    on = case.to(device)
    lora_expand_triton(on.y, z.to(device), on.lora_b, on.seg, n_offset=n_offset)
    assert_close(on.y, lora_expand_ref(case.y, z, case.lora_b, case.seg, n_offset), torch.float16)


def test_expand_accepts_z_in_the_output_dtype(device):
    case = make_case(MIXED, hidden=16, n=20, rank=16, dtype=torch.float16)
    z = torch.randn((case.seg.num_tokens, 16), generator=torch.Generator().manual_seed(4)).half()
    on = case.to(device)
    lora_expand_triton(on.y, z.to(device), on.lora_b, on.seg)
    assert_close(on.y, lora_expand_ref(case.y, z, case.lora_b, case.seg), torch.float16)


def test_rejects_unsupported_rank_and_mismatches(device):
    case = make_case(DECODE, hidden=16, n=16, rank=72, dtype=torch.float32).to(device)
    with pytest.raises(ValueError, match="rank 72"):
        lora_shrink_triton(case.x, case.lora_a, case.seg, case.scale)
    with pytest.raises(ValueError, match="dtypes"):
        lora_shrink_triton(case.x.half(), case.lora_a, case.seg, case.scale)
    with pytest.raises(ValueError, match="segments.token_indices"):
        lora_shrink_triton(case.x, case.lora_a, case.seg.to("meta"), case.scale)
    with pytest.raises(ValueError, match="n_offset"):
        lora_expand_triton(case.y, torch.zeros((1, 72), device=device), case.lora_b, case.seg, n_offset=1)


def test_padded_static_segments_give_the_steps_result(device):
    """A CUDA graph's LoRA segments (lora/segments.py pad_segments): the step's segments copied into static buffers
    of 8 segment slots and the batch's 13 rows, the rest empty, the grid sized for 13-row segments: the same output
    as the step's own segments (z rows past the step's are never read; y rows outside the segments are untouched)."""
    from steploop.gpu_worker.lora.segments import LoraSegments, pad_segments

    case = make_case(MIXED, hidden=40, n=72, rank=16, dtype=torch.float32)
    on = case.to(device)
    want_y = on.y.clone()
    z = lora_shrink_triton(on.x, on.lora_a, on.seg, on.scale)
    lora_expand_triton(want_y, z, on.lora_b, on.seg)
    t = len(case.token_slots)
    tokens = torch.full((t,), 5, dtype=torch.int64, device=device)
    segs = torch.full((3, 8), 7, dtype=torch.int32, device=device)
    pad_segments(on.seg, tokens, segs)
    static = LoraSegments(tokens, segs[0], segs[1], segs[2], t, t, ((0, 0, 0),) * 8)
    got_y = on.y.clone()
    z_static = lora_shrink_triton(on.x, on.lora_a, static, on.scale)
    lora_expand_triton(got_y, z_static, on.lora_b, static)
    assert_close(z_static[:case.seg.num_tokens], z, torch.float32)
    assert_close(got_y, want_y, torch.float32)
    base = [i for i, s in enumerate(case.token_slots) if s < 0]
    assert torch.equal(got_y[base], on.y[base])
