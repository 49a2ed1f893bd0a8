"""Large CPU tensors in transparent huge pages (2 MiB) where Linux allows it.

The KV cache is read in blocks of a few KiB scattered over gigabytes: with 4 KiB pages nearly every block costs a TLB
miss and a page walk (measured: the C paged attention ~10% faster per layer in huge pages, 16 requests x 144
tokens and 64 x 256, blocks scattered over a pool 4x the batch's). Hosts with THP in `madvise` mode (the
common default) give huge pages only to mappings that ask, so the cache comes from its own anonymous mmap with
MADV_HUGEPAGE. Anywhere that is not possible (not Linux, THP off, small tensors) it is a plain torch
tensor; the values are the same either way. STEPLOOP_CPU_HUGEPAGES=0 turns it off (through the KernelPlan).
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor; backed by huge pages when huge (KernelPlan.hugepages), the OS has MADV_HUGEPAGE and it
    spans at least one."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not huge or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)    # before the first touch, so the pages fault in huge
    except OSError:                        # THP not built in: the mapping still works, in small pages
        pass
    # anonymous memory is zero-filled; the tensor keeps the mapping alive (frombuffer holds the buffer)
    t = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)
    # fault every page in now (as torch.zeros does): left to the first write, each 2 MiB page was zeroed by the
    # kernel inside a decode step (clear_page: 4.6% of the worker's CPU in a fresh server's first minute at 64
    # concurrent), and a pool larger than the memory left would fail mid-serving rather than at start
    t.zero_()
    return t

