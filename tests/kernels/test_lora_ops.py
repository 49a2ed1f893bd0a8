"""The LoRA dispatch (lora_ops) against the row-at-a-time references: on CPU tensors its torch path (the one the
CPU worker serves with), on CUDA the Triton kernels. Includes a fused qkv-style output, one shrink for all slices."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest
import torch

from steploop.gpu_worker.kernels.lora_ops import lora_expand, lora_expand_slices, lora_shrink
from steploop.gpu_worker.kernels.lora_reference import lora_delta_ref, lora_shrink_ref
from steploop.gpu_worker.lora.segments import build_lora_segments
from tests.kernels.conftest import assert_close
from tests.kernels.lora_cases import CHUNK, DECODE, MIXED, WHOLE, make_case

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("token_slots", [MIXED, DECODE, CHUNK, WHOLE], ids=["mixed", "decode", "long-chunk", "whole"])
@pytest.mark.parametrize("rank", [8, 64])
def test_dispatch_matches_reference(rank, token_slots, dtype, device):
    case = make_case(token_slots, hidden=72, n=40, rank=rank, dtype=dtype)
    on = case.to(device)
    z = lora_shrink(on.x, on.lora_a, on.seg, on.scale)
    assert_close(z, lora_shrink_ref(case.x, case.lora_a, case.seg, case.scale), dtype, scale=2.0)
    lora_expand(on.y, z, on.lora_b, on.seg)
    expected = case.y.float() + lora_delta_ref(case.x, case.lora_a, case.lora_b, case.token_slots, case.scale)
    assert_close(on.y, expected, dtype, scale=4.0)


@pytest.mark.parametrize("one_call", [True, False], ids=["expand_slices", "expand-per-slice"])
def test_fused_slices_take_their_own_columns(one_call, device):
    """qkv: A of the three slices stacked [L, 3R, H] for one shrink; each slice expands from its columns of z."""
    q, kv, rank = 48, 16, 8
    parts = [make_case(MIXED, hidden=64, n=n, rank=rank, dtype=torch.float32, seed=s)
             for s, n in enumerate((q, kv, kv))]
    seg = build_lora_segments(torch.tensor(MIXED, dtype=torch.int32)).to(device)
    x, scale = parts[0].x, parts[0].scale
    stacked_a = torch.cat([p.lora_a for p in parts], dim=1)                  # [L, 3R, H]
    z = lora_shrink(x.to(device), stacked_a.to(device), seg, scale.to(device))
    y = torch.zeros((len(MIXED), q + 2 * kv), device=device)
    bs, offsets = [p.lora_b.to(device) for p in parts], [0, q, q + kv]
    if one_call:
        lora_expand_slices(y, z, bs, seg, offsets)
    else:
        for i, (b, offset) in enumerate(zip(bs, offsets)):
            lora_expand(y, z[:, i * rank:(i + 1) * rank], b, seg, n_offset=offset)
    expected = torch.cat([lora_delta_ref(x, p.lora_a, p.lora_b, MIXED, scale) for p in parts], dim=1)
    assert_close(y, expected, torch.float32)


def test_expand_slices_rejects_a_z_of_other_ranks(device):
    case = make_case(MIXED, hidden=16, n=16, rank=8, dtype=torch.float32).to(device)
    with pytest.raises(ValueError, match="ranks of 2 slices"):
        lora_expand_slices(case.y, torch.zeros((case.seg.num_tokens, 8), device=device), [case.lora_b] * 2,
                           case.seg, [0, 8])


def test_base_rows_are_untouched(device):
    case = make_case(MIXED, hidden=32, n=24, rank=16, dtype=torch.float16)
    on = case.to(device)
    lora_expand(on.y, lora_shrink(on.x, on.lora_a, on.seg, on.scale), on.lora_b, on.seg)
    base = [row for row, slot in enumerate(MIXED) if slot < 0]
    assert torch.equal(on.y[base].cpu(), case.y[base])


def test_cpu_path_restores_the_thread_count():
    """The CPU path runs its small ops on one thread and gives the worker its threads back, also on errors."""
    case = make_case(MIXED, hidden=16, n=16, rank=8, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lora_expand(case.y, lora_shrink(case.x, case.lora_a, case.seg, case.scale), case.lora_b, case.seg)
        assert torch.get_num_threads() == 2
        with pytest.raises(IndexError):   # a row past y's end (rows are the caller's contract): fails inside
            lora_expand(case.y[:11], torch.zeros((case.seg.num_tokens, 8)), case.lora_b, case.seg)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_rejects_segments_without_host_segments(device):
    case = make_case(MIXED, hidden=16, n=16, rank=8, dtype=torch.float32).to(device)
    bare = dataclasses.replace(case.seg, host_segments=())
    with pytest.raises(ValueError, match="build_lora_segments"):
        lora_shrink(case.x, case.lora_a, bare, case.scale)


def test_cpu_path_imports_no_triton():
    """The `[worker-cpu]` install has no triton: the dispatch must import it only for CUDA tensors."""
    code = ("import sys, torch\n"
            "from steploop.gpu_worker.kernels.lora_ops import lora_expand, lora_shrink\n"
            "from steploop.gpu_worker.lora.segments import build_lora_segments\n"
            "seg = build_lora_segments(torch.tensor([0, -1, 0], dtype=torch.int32))\n"
            "y = torch.zeros(3, 4)\n"
            "lora_expand(y, lora_shrink(torch.ones(3, 8), torch.ones(1, 2, 8), seg, torch.ones(1)), "
            "torch.ones(1, 4, 2), seg)\n"
            "assert y[0].tolist() == [16.0] * 4 and y[1].tolist() == [0.0] * 4, y\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
