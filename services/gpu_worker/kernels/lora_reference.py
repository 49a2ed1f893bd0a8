"""Slow, obvious torch references for the LoRA shrink and expand: one row at a time, fp32 math.
Tests compare the kernels and the CPU path with these; nothing in serving calls them."""

from __future__ import annotations

import torch

from steploop.gpu_worker.lora.segments import LoraSegments


def _row_slots(seg: LoraSegments) -> list[int]:
    return [slot for _, n, slot in seg.host_segments for _ in range(n)]


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, seg: LoraSegments, scale: torch.Tensor) -> torch.Tensor:
    """z[i] = scale[slot] * x[token_indices[i]] @ A[slot]^T -> [T', R] fp32."""
    z = torch.empty((seg.num_tokens, lora_a.shape[1]), dtype=torch.float32)
    for i, (row, slot) in enumerate(zip(seg.token_indices.tolist(), _row_slots(seg))):
        z[i] = float(scale[slot]) * (lora_a[slot].float().cpu() @ x[row].float().cpu())
    return z


def lora_expand_ref(y: torch.Tensor, z: torch.Tensor, lora_b: torch.Tensor, seg: LoraSegments,
                    n_offset: int = 0) -> torch.Tensor:
    """Out of place: y with y[token_indices[i], n_offset:n_offset + N] += z[i] @ B[slot]^T, in fp32."""
    out = y.float().cpu().clone()
    n = lora_b.shape[1]
    for i, (row, slot) in enumerate(zip(seg.token_indices.tolist(), _row_slots(seg))):
        out[row, n_offset:n_offset + n] += lora_b[slot].float().cpu() @ z[i].float().cpu()
    return out


def lora_delta_ref(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: list[int],
                   scale: torch.Tensor) -> torch.Tensor:
    """What LoRA adds to each row of the base output, from each token's slot alone (no segments): [T, N] fp32."""
    delta = torch.zeros((x.shape[0], lora_b.shape[1]), dtype=torch.float32)
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            a, b = lora_a[slot].float().cpu(), lora_b[slot].float().cpu()
            delta[row] = float(scale[slot]) * (b @ (a @ x[row].float().cpu()))
    return delta
