"""LoRA segments: rows grouped by adapter slot, stable, checked against a plain per-token loop."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.lora.segments import build_lora_segments


def expected_groups(token_slots: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            groups.setdefault(slot, []).append(row)
    return dict(sorted(groups.items()))


@pytest.mark.parametrize("token_slots", [
    [2, -1, 0, 2, 0, -1],               # the docstring's example
    [0],                                # one decode
    [3] * 40,                           # one long prompt chunk
    [5, -1, 1, 1, 1, 7, -1, 5, 0, 1],   # mixed, slots out of order
], ids=["example", "one-decode", "one-chunk", "mixed"])
def test_groups_rows_by_slot_stably(token_slots):
    seg = build_lora_segments(torch.tensor(token_slots, dtype=torch.int32))
    groups = expected_groups(token_slots)
    assert seg.seg_slots.tolist() == list(groups)
    assert seg.seg_lens.tolist() == [len(rows) for rows in groups.values()]
    assert seg.token_indices.tolist() == [row for rows in groups.values() for row in rows]
    assert seg.seg_starts.tolist() == [sum(seg.seg_lens.tolist()[:i]) for i in range(len(groups))]
    assert seg.num_tokens == sum(len(rows) for rows in groups.values())
    assert seg.max_seg_len == max(len(rows) for rows in groups.values())
    assert seg.host_segments == tuple(zip(seg.seg_starts.tolist(), seg.seg_lens.tolist(), seg.seg_slots.tolist()))
    assert seg.token_indices.dtype == torch.int64
    assert {seg.seg_starts.dtype, seg.seg_lens.dtype, seg.seg_slots.dtype} == {torch.int32}


def test_random_batch_matches_loop():
    gen = torch.Generator().manual_seed(0)
    token_slots = torch.randint(-1, 6, (500,), generator=gen, dtype=torch.int32)
    seg = build_lora_segments(token_slots)
    groups = expected_groups(token_slots.tolist())
    assert seg.token_indices.tolist() == [row for rows in groups.values() for row in rows]
    assert seg.seg_slots.tolist() == list(groups)


@pytest.mark.parametrize("token_slots", [[-1, -1, -1], []], ids=["base-only", "empty"])
def test_no_adapter_rows_is_none(token_slots):
    assert build_lora_segments(torch.tensor(token_slots, dtype=torch.int32)) is None


def test_int64_slots_and_to_device():
    seg = build_lora_segments(torch.tensor([1, 0, 1], dtype=torch.int64)).to("cpu")
    assert seg.token_indices.tolist() == [1, 0, 2] and seg.seg_slots.dtype == torch.int32


@pytest.mark.parametrize("bad", [torch.zeros((2, 2), dtype=torch.int32), torch.zeros(3)], ids=["2-d", "float"])
def test_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="token_slots"):
        build_lora_segments(bad)
