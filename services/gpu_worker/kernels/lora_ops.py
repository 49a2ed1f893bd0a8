"""Batched LoRA for one projection of one step, on whatever device the tensors live on:

    z = lora_shrink(x, lora_a, seg, scale)          # [T', R]  scale[slot] * x[token_indices] @ A[slot]^T
    lora_expand(y, z, lora_b, seg, n_offset)        # y[token_indices, n_offset:n_offset + N] += z @ B[slot]^T

CUDA tensors run the Triton kernels (lora_shrink.py, lora_expand.py; z is fp32). CPU tensors run a torch path
that serves real traffic: one index_select of the adapter rows, one matmul per segment (segments = distinct
adapters in the step, at most --max-loras), one index_add_ back; z is in x's dtype, as peft's lora_A output is.
The Triton modules are imported on first CUDA use only, so the CPU path never imports triton.

For a fused projection (qkv, gate_up), stack the slices' A as [L, sum R_i, H] for one shrink, then expand each
slice from its column slice of z with its own B and n_offset.
"""

from __future__ import annotations

import torch

from services.gpu_worker.kernels import lora_meta
from services.gpu_worker.lora.segments import LoraSegments


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg: LoraSegments, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H], lora_a [L, R, H], scale [L] fp32 -> z [T', R] (fp32 on CUDA, x's dtype on the CPU)."""
    if x.is_cuda:
        from services.gpu_worker.kernels.lora_shrink import lora_shrink_triton
        return lora_shrink_triton(x, lora_a, seg, scale)
    lora_meta.check_shrink(x, lora_a, scale)
    lora_meta.check_segments(seg, x.shape[0], lora_a.shape[0], x.device)
    rows = x.index_select(0, seg.token_indices)                                  # [T', H]
    z = torch.empty((seg.num_tokens, lora_a.shape[1]), dtype=x.dtype)
    scales = scale.tolist()
    for start, n, slot in seg.host_segments:
        out = z[start:start + n]
        torch.mm(rows[start:start + n], lora_a[slot].t(), out=out)
        out.mul_(scales[slot])
    return z


def lora_expand(y: torch.Tensor, z: torch.Tensor, lora_b: torch.Tensor, seg: LoraSegments, n_offset: int = 0) -> None:
    """In place: y [T, N_total] columns [n_offset, n_offset + N) += z [T', R] @ lora_b [L, N, R]^T per segment."""
    if y.is_cuda:
        from services.gpu_worker.kernels.lora_expand import lora_expand_triton
        lora_expand_triton(y, z, lora_b, seg, n_offset)
        return
    lora_meta.check_expand(y, z, lora_b, seg, n_offset)
    lora_meta.check_segments(seg, y.shape[0], lora_b.shape[0], y.device)
    z = z.to(lora_b.dtype)
    delta = torch.empty((seg.num_tokens, lora_b.shape[1]), dtype=y.dtype)
    for start, n, slot in seg.host_segments:
        torch.mm(z[start:start + n], lora_b[slot].t(), out=delta[start:start + n])
    y.narrow(1, n_offset, lora_b.shape[1]).index_add_(0, seg.token_indices, delta)
