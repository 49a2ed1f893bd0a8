"""The CPU serving path's shrink and expand (services/gpu_worker/lora/torch_ops.py) against the obvious per-token
loop, on batches mixing base rows and several adapters, at a column offset of a fused projection."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.lora import torch_ops
from services.gpu_worker.lora.segments import build_lora_segments


def per_token(y, x, a, b, scale, slots, offset):
    out = y.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[row, offset:offset + b.shape[1]] += scale[slot] * (x[row] @ a[slot].t()) @ b[slot].t()
    return out


@pytest.mark.parametrize("slots", [[0, -1, 2, 2, -1, 1, 0, 0], [3, 3, 3], [-1, 1]])
def test_shrink_expand_equal_the_per_token_loop(slots):
    gen = torch.Generator().manual_seed(len(slots))
    slots = torch.tensor(slots, dtype=torch.int32)
    t, hidden, rank, out_features, offset = len(slots), 24, 8, 10, 6
    x = torch.randn(t, hidden, generator=gen)
    a, b = torch.randn(4, rank, hidden, generator=gen), torch.randn(4, out_features, rank, generator=gen)
    scale = torch.tensor([0.5, 2.0, 1.0, 0.25])
    y = torch.randn(t, offset + out_features + 3, generator=gen)
    want = per_token(y, x, a, b, scale, slots, offset)
    seg = build_lora_segments(slots)
    torch_ops.expand(y, torch_ops.shrink(x, a, seg, scale), b, seg, offset)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
