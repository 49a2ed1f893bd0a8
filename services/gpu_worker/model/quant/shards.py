"""One tensor-parallel rank's share of a quantized linear (formats.py's common form), cut at the stored width:

    column-parallel (q/k/v, gate/up)   rows of q, scale, zero (FP8: of the weight, and of a per-channel scale)
    row-parallel (o_proj, down_proj)   input columns of q with their groups' scale / zero columns: the split must
                                       fall on a group boundary (distributed/stored_split.py refuses one that does
                                       not, at start); a per-channel scale is whole on every rank
    act-order (GPTQ desc_act) rows     g_idx cut with q's columns; the groups it names in the shard keep their
                                       scale / zero columns, renumbered. When each group then holds the same number
                                       of the shard's columns that is the shard's group size and the layer packs as
                                       on one rank; otherwise the group sizes are uneven (group_size 0: only g_idx
                                       says) and the layer computes the reference formula in torch (linear.py).

The values are the whole layer's: w_local = w[rows] or w[:, cols] exactly, for every format.
"""

from __future__ import annotations

import logging

import torch

from steploop.gpu_worker.model.quant.formats import Fp8Weight, IntWeight

log = logging.getLogger(__name__)


def shard_weight(w: IntWeight | Fp8Weight, split: tuple[int, int, int] | None, name: str) -> IntWeight | Fp8Weight:
    """split: CheckpointSharder.split's (dim, start, size), or None (the rank holds the layer whole)."""
    if split is None:
        return w
    dim, start, size = split
    cut = slice(start, start + size)
    if isinstance(w, Fp8Weight):
        if dim == 1:
            return Fp8Weight(w.weight[:, cut].contiguous(), w.scale)
        return Fp8Weight(w.weight[cut].contiguous(), w.scale[cut] if w.scale.shape[0] > 1 else w.scale)
    if dim == 0:
        return IntWeight(w.q[cut].contiguous(), w.scale[cut].contiguous(), w.zero[cut].contiguous(), w.g_idx,
                         w.group_size, w.bits)
    if w.g_idx is not None:
        return _act_order_columns(w, cut, size, name)
    k = w.q.shape[1]
    if w.group_size == k:                      # per channel: one scale per row, whatever the columns
        return IntWeight(w.q[:, cut].contiguous(), w.scale, w.zero, None, size, w.bits)
    if start % w.group_size or size % w.group_size:
        raise ValueError(f"{name}: input columns [{start}, {start + size}) are not whole groups of {w.group_size}")
    groups = slice(start // w.group_size, (start + size) // w.group_size)
    return IntWeight(w.q[:, cut].contiguous(), w.scale[:, groups].contiguous(), w.zero[:, groups].contiguous(),
                     None, w.group_size, w.bits)


def _act_order_columns(w: IntWeight, cut: slice, size: int, name: str) -> IntWeight:
    g = w.g_idx[cut]
    groups, local = torch.unique(g, sorted=True, return_inverse=True)
    counts = torch.bincount(local)
    even = bool((counts == counts[0]).all())
    if not even:
        log.warning("%s: act-order groups split unevenly by -tp (%d to %d of this rank's %d columns per group): "
                    "this layer keeps 8-bit codes and computes the reference formula in torch on this rank "
                    "(exact, slower than the packed kernel)", name, int(counts.min()), int(counts.max()), size)
    return IntWeight(w.q[:, cut].contiguous(), w.scale[:, groups].contiguous(), w.zero[:, groups].contiguous(),
                     local, int(counts[0]) if even else 0, w.bits)
