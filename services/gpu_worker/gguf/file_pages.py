"""The GGUF file's mapped pages, dropped from the worker's resident set as soon as they are read (they stay in the
page cache, and a later read faults them back in): a mapped page counts in RSS while it is mapped, so reading the
whole file would add its size to the load's peak, and reading one vocabulary-sized table (~0.4 GB in an 8B file)
its size. The mapping is read-only and file-backed, so dropping any of its pages loses nothing."""

from __future__ import annotations

import mmap


class FilePages:
    def __init__(self, reader):
        mm = getattr(reader.data, "_mmap", None)
        self.mm = mm if mm is not None and hasattr(mm, "madvise") else None

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

    def drop_rows(self, tensor, index: int | None, r0: int, r1: int) -> None:
        """Rows [r0, r1) of a block tensor's raw rows ([rows, row bytes], or expert `index` of [experts, rows,
        row bytes]), as they lie in the file."""
        rows, row_bytes = tensor.data.shape[-2:]
        first = (index or 0) * rows
        self.drop(tensor.data_offset + (first + r0) * row_bytes, tensor.data_offset + (first + r1) * row_bytes)
