"""Writing new K/V into the paged cache by slot, against the reference loop."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.kernels.cache_write import write_kv_cache
from steploop.gpu_worker.kernels.reference import write_kv_cache_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hk,head_dim", [(3, 64), (2, 128)])
def test_matches_reference(dtype, hk, head_dim, device):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, t = 6, 16, 11
    qkv = torch.randn((t, (4 + 2 * hk) * head_dim), generator=gen).to(dtype)   # k, v are strided views of it
    k = qkv[:, 4 * head_dim:(4 + hk) * head_dim].view(t, hk, head_dim)
    v = qkv[:, (4 + hk) * head_dim:].view(t, hk, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[[2, 7]] = -1                                                  # padding rows are skipped
    cache = torch.randn((2, num_blocks, block_size, hk, head_dim), generator=gen).to(dtype)
    expected = cache.clone()
    write_kv_cache_ref(k, v, expected, slots)
    cache, k, v, slots = cache.to(device), k.to(device), v.to(device), slots.to(device)
    write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache.cpu(), expected)


def test_rejects_int32_slots(device):
    k = torch.zeros((2, 1, 64), device=device)
    with pytest.raises(ValueError, match="int64"):
        write_kv_cache(k, k, torch.zeros((2, 2, 16, 1, 64), device=device),
                       torch.zeros(2, dtype=torch.int32, device=device))
