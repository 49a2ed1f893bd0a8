"""The LoRA dispatch (lora_ops) against the row-at-a-time references: on CPU tensors its torch path (the one the
CPU worker serves with), on CUDA the Triton kernels. Includes a fused qkv-style output, one shrink for all slices."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.lora_ops import lora_expand, lora_shrink
from services.gpu_worker.kernels.lora_reference import lora_delta_ref, lora_shrink_ref
from services.gpu_worker.lora.segments import build_lora_segments
from tests.kernels.conftest import assert_close
from tests.kernels.lora_cases import CHUNK, DECODE, MIXED, make_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("token_slots", [MIXED, DECODE, CHUNK], ids=["mixed", "decode", "long-chunk"])
@pytest.mark.parametrize("rank", [8, 64])
def test_dispatch_matches_reference(rank, token_slots, dtype, device):
    case = make_case(token_slots, hidden=72, n=40, rank=rank, dtype=dtype)
    on = case.to(device)
    z = lora_shrink(on.x, on.lora_a, on.seg, on.scale)
    assert_close(z, lora_shrink_ref(case.x, case.lora_a, case.seg, case.scale), dtype, scale=2.0)
    lora_expand(on.y, z, on.lora_b, on.seg)
    expected = case.y.float() + lora_delta_ref(case.x, case.lora_a, case.lora_b, case.token_slots, case.scale)
    assert_close(on.y, expected, dtype, scale=4.0)


def test_fused_slices_take_their_own_columns(device):
    """qkv: A of the three slices stacked [L, 3R, H] for one shrink; each slice expands from its columns of z."""
    q, kv, rank = 48, 16, 8
    parts = [make_case(MIXED, hidden=64, n=n, rank=rank, dtype=torch.float32, seed=s)
             for s, n in enumerate((q, kv, kv))]
    seg = build_lora_segments(torch.tensor(MIXED, dtype=torch.int32)).to(device)
    x, scale = parts[0].x, parts[0].scale
    stacked_a = torch.cat([p.lora_a for p in parts], dim=1)                  # [L, 3R, H]
    y = torch.zeros((len(MIXED), q + 2 * kv))
    z = lora_shrink(x.to(device), stacked_a.to(device), seg, scale.to(device))
    y = y.to(device)
    for i, (p, offset) in enumerate(zip(parts, (0, q, q + kv))):
        lora_expand(y, z[:, i * rank:(i + 1) * rank], p.lora_b.to(device), seg, n_offset=offset)
    expected = torch.cat([lora_delta_ref(x, p.lora_a, p.lora_b, MIXED, scale) for p in parts], dim=1)
    assert_close(y, expected, torch.float32)


def test_base_rows_are_untouched(device):
    case = make_case(MIXED, hidden=32, n=24, rank=16, dtype=torch.float16)
    on = case.to(device)
    lora_expand(on.y, lora_shrink(on.x, on.lora_a, on.seg, on.scale), on.lora_b, on.seg)
    base = [row for row, slot in enumerate(MIXED) if slot < 0]
    assert torch.equal(on.y[base].cpu(), case.y[base])
