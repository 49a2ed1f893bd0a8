"""The GGUF file's mapped pages, dropped from the worker's resident set as soon as they are read (they stay in the
page cache, and a later read faults them back in): a mapped page counts in RSS while it is mapped, so reading the
whole file would add its size to the load's peak, and reading one vocabulary-sized table (~0.4 GB in an 8B file)
its size. The mapping is read-only and file-backed, so dropping any of its pages loses nothing."""

from __future__ import annotations

import mmap

import numpy as np
from numpy.lib.array_utils import byte_bounds


class FilePages:
    def __init__(self, reader):
        mm = getattr(reader.data, "_mmap", None)
        self.mm = mm if mm is not None and hasattr(mm, "madvise") else None
        self.base = reader.data.ctypes.data if self.mm is not None else 0     # the mapping's first byte's address

    def drop(self, start: int, end: int) -> None:
        """Bytes [start, end) of the file (widened to whole pages)."""
        if self.mm is None:
            return
        page = mmap.PAGESIZE
        start, end = start // page * page, min(-(-end // page) * page, len(self.mm))
        if end > start:
            self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def drop_tensors(self, tensors) -> None:
        for tensor in {id(t): t for t in tensors}.values():           # experts share their stacked tensor
            self.drop(tensor.data_offset, tensor.data_offset + int(tensor.n_bytes))

    def drop_view(self, view: np.ndarray) -> None:
        """The bytes a view of the mapped file spans (a rank's cut of a tensor's rows or columns: found by address);
        nothing for an array that is not a view of it (llama's q/k rows unpermuted, a padded vocabulary share are
        copies, their pages dropped with the whole tensor's)."""
        if self.mm is None or view.size == 0:
            return
        lo, hi = byte_bounds(view)
        if self.base <= lo and hi <= self.base + len(self.mm):
            self.drop(lo - self.base, hi - self.base)
