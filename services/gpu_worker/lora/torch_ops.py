"""The LoRA shrink and expand in plain torch: the CPU's serving path, over the same LoraSegments as the Triton
kernels (services/gpu_worker/kernels/lora_ops.py, used on CUDA) and with the same signatures.

    z = shrink(x [T, H], lora_a [L, R, H], seg, scale [L])       -> [T', R]   z = scale[slot] * x[rows] @ A[slot]^T
    expand(y [T, N], z [T', R], lora_b [L, N_b, R], seg, n_offset)            y[rows, n_offset:+N_b] += z @ B[slot]^T

Per segment one matmul on the gathered rows (an adapter's prompt chunks and decodes together), then one
index_add_ for the whole expand: the cost is two skinny matmuls per adapter, not per token.
"""

from __future__ import annotations

import torch

from services.gpu_worker.lora.segments import LoraSegments


def shrink(x: torch.Tensor, lora_a: torch.Tensor, seg: LoraSegments, scale: torch.Tensor) -> torch.Tensor:
    z = x.new_empty(seg.num_tokens, lora_a.shape[1])
    rows = x.index_select(0, seg.token_indices)              # [T', H] gathered once for every segment
    for start, n, slot in seg.host_segments:
        torch.matmul(rows[start:start + n], lora_a[slot].t(), out=z[start:start + n])
        z[start:start + n].mul_(scale[slot].to(z.dtype))
    return z


def expand(y: torch.Tensor, z: torch.Tensor, lora_b: torch.Tensor, seg: LoraSegments, n_offset: int = 0) -> None:
    out_features = lora_b.shape[1]
    delta = y.new_empty(seg.num_tokens, out_features)
    for start, n, slot in seg.host_segments:
        torch.matmul(z[start:start + n], lora_b[slot].t(), out=delta[start:start + n])
    y[:, n_offset:n_offset + out_features].index_add_(0, seg.token_indices, delta)
