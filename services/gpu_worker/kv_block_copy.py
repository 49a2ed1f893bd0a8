"""Copy on write of KV blocks: a plan's `block_copies` (a beam that forks gets its own copy of its parent's
partial last block, scheduler/beam_groups.py), done after the KV tier moves and before the forward.

Every layer's cache is [2, num_blocks, ...] (K and V first, kv_cache.allocate_kv_caches): one gather-then-scatter
per layer copies all of a step's blocks, on the cache's own device and stream, so the forward that follows sees
them (the scheduler keeps both blocks of a copy from reuse until the plan is built, so nothing else in the step
touches them first)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from steploop.gpu_worker.kv_cache_dtype import as_bytes


def copy_blocks(caches: Sequence[torch.Tensor], copies: Sequence[tuple[int, int]]) -> None:
    """copies: (source block, destination block) pairs; a destination is never a source of the same call."""
    if not copies:
        return
    device = caches[0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for cache in caches:
        cache = as_bytes(cache)
        cache[:, dst] = cache[:, src]
