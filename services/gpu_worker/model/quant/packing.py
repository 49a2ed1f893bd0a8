"""IntWeight (formats.py) -> the packed forms packed_linear.c computes, without an fp32 copy of the weight:

    int4 codes with a group scale and zero:  w = scale * (q - zero) = d * q + m,  d = scale, m = -scale * zero
        -> Q4_1 (fp32 d and m per 32-block along K; a group of 64 or 128 is 2 or 4 blocks with the same d, m)
    int8 codes with zero 128 (symmetric):    w = scale * (q - 128)
        -> Q8_0 (int8 q - 128, fp32 d per 32-block): the same product as the reference, bit for bit

d * q + m is the reference's scale * (q - zero) up to one fp32 rounding (m is rounded once). Act-order (GPTQ
desc_act) weights have their K permuted first so that every group is contiguous (as vLLM's act-order shuffle);
the layer permutes its input the same way (linear.py).
"""

from __future__ import annotations

import torch

from steploop.gpu_worker.cpu_kernels.packed_weights import GROUP, Q4_1, Q8_0, QK, PackedWeight
from steploop.gpu_worker.model.quant.formats import IntWeight


def contiguous_groups(w: IntWeight) -> tuple[IntWeight, torch.Tensor | None]:
    """(the weight with K ordered by group, the input permutation or None): act-order's g_idx made plain."""
    if w.g_idx is None:
        return w, None
    perm = torch.argsort(w.g_idx, stable=True)        # column j of the result is input column perm[j]
    return IntWeight(w.q[:, perm].contiguous(), w.scale, w.zero, None, w.group_size, w.bits), perm.to(torch.int32)


def packable(w: IntWeight) -> bool:
    """Whether the C kernel's layout holds it: 16-row groups, whole 32-blocks inside each quantization group, and
    an int8 form with a fixed zero of 128 (asymmetric int8 has no C kind: linear.py computes it in torch)."""
    n, k = w.q.shape
    if n % GROUP or k % QK or w.group_size <= 0 or w.group_size % QK or w.g_idx is not None:   # 0: uneven groups
        return False
    return w.bits == 4 or (w.bits == 8 and bool((w.zero == 128).all()))


def _per_block(t: torch.Tensor, w: IntWeight) -> torch.Tensor:
    """[N, G] per group -> [N/16, K/32, 16] per 32-block (each group's value repeated over its blocks)."""
    n = t.shape[0]
    blocks = t.repeat_interleave(w.group_size // QK, dim=1)                    # [N, K/32]
    return blocks.view(n // GROUP, GROUP, -1).permute(0, 2, 1).contiguous()


def pack_int(w: IntWeight) -> PackedWeight:
    n, k = w.q.shape
    if not packable(w):
        raise ValueError(f"[{n}, {k}] int{w.bits} group {w.group_size} does not fit the packed layout")
    d = _per_block(w.scale, w)
    if w.bits == 4:
        pairs = w.q.view(n // GROUP, GROUP, k // 2, 2).permute(0, 2, 1, 3)     # [N/16, K/2, 16, (even, odd)]
        qs = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
        return PackedWeight(Q4_1, qs, d, _per_block(-w.scale * w.zero, w), n, k)
    q8 = (w.q.to(torch.int16) - 128).to(torch.int8)
    return PackedWeight(Q8_0, q8.view(n // GROUP, GROUP, k).permute(0, 2, 1).contiguous(), d, None, n, k)


def concat(parts: list[PackedWeight]) -> PackedWeight:
    """Row-stack packed weights of one kind (q/k/v, gate/up): the layout is per 16-row group, so it concatenates."""
    first = parts[0]
    if len(parts) == 1:
        return first
    cat = lambda ts: torch.cat(ts, dim=0)
    return PackedWeight(first.kind, cat([p.qs for p in parts]), cat([p.d for p in parts]),
                        None if first.m is None else cat([p.m for p in parts]),
                        sum(p.out_features for p in parts), first.in_features)
