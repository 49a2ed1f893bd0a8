"""Block tables kept on the device between steps, updated by the plan's diffs (vLLM's persistent batch).

Each live request owns one row of a [rows, width] int32 table, for its whole life on this worker:

    row of handle 7:   | b0 | b1 | b2 | 0 | 0 | ... |      num_blocks[row] = 3
    plan appends [b3]:  only entry (row, 3) changes    -> one diff
    handle 7 finishes:  entries (row, 0..3) back to 0  -> four diffs, the row returns to the free list

`host` is the authoritative copy (numpy, what the step's KV slots are computed from); `device` mirrors it. Writes
mark flat indices dirty; once per step the dirty (index, value) pairs travel in the step's staging buffer and one
index_copy_ on the device applies them. A step's table [R, max_blocks] is a gather of its requests' rows on the
device, so nothing is rebuilt from Python lists. Entries past a row's blocks are 0 (the null block), as before.
Growth (more rows, or a wider row) reallocates both copies (a device-to-device copy of the old table; rare).
"""

from __future__ import annotations

import numpy as np
import torch

from steploop.gpu_worker.staging import StepStaging


class PersistentBlockTable:
    def __init__(self, device: torch.device | str = "cpu", rows: int = 64, width: int = 64):
        self.device = torch.device(device)
        self.host = np.zeros((rows, width), dtype=np.int32)              # [rows, width] block ids, 0 = null
        self.device_table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        self.num_blocks = np.zeros(rows, dtype=np.int32)                 # [rows] blocks each row holds
        self.row_of: dict[int, int] = {}                                 # handle -> row
        self.free_rows = list(range(rows - 1, -1, -1))                  # popped from the end: lowest row first
        self._dirty: list[np.ndarray] = []                               # flat indices written since the last sync
        self._staged: tuple[int, int, int] | None = None                 # (indices slot, values slot, lists sent)

    def add(self, handle: int, block_ids: list[int]) -> None:
        if not self.free_rows:
            self._resize(2 * len(self.host), self.host.shape[1])
        row = self.free_rows.pop()
        self.row_of[handle] = row
        self.num_blocks[row] = 0
        self.append(handle, block_ids)

    def append(self, handle: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[handle]
        start, end = int(self.num_blocks[row]), int(self.num_blocks[row]) + len(block_ids)
        if end > self.host.shape[1]:
            self._resize(len(self.host), max(end, 2 * self.host.shape[1]))
        self.host[row, start:end] = block_ids
        self.num_blocks[row] = end
        self._mark(row, start, end)

    def remove(self, handle: int) -> None:
        row = self.row_of.pop(handle, None)
        if row is None:
            return
        n = int(self.num_blocks[row])
        self.host[row, :n] = 0
        self.num_blocks[row] = 0
        self._mark(row, 0, n)
        self.free_rows.append(row)

    def clear(self) -> None:
        for handle in list(self.row_of):
            self.remove(handle)

    def rows(self, handles: list[int]) -> np.ndarray:
        """[R] int64 rows of these handles, in order."""
        row_of = self.row_of
        return np.fromiter((row_of[h] for h in handles), np.int64, len(handles))

    def stage(self, staging: StepStaging) -> None:
        """Put the pending diffs (deduplicated: a row freed and reused in one plan is written once) in the staging.
        They stay pending until apply(): a step that fails in between sends them again with the next one."""
        if not self._dirty:
            self._staged = None
            return
        idx = np.unique(np.concatenate(self._dirty))
        self._staged = (staging.put(idx), staging.put(self.host.reshape(-1)[idx]), len(self._dirty))

    def apply(self, staging: StepStaging) -> None:
        """After the staging's send: apply the diffs to the device copy (device-side, no host round trip)."""
        if self._staged is not None:
            idx, values, num_lists = self._staged
            self.device_table.view(-1).index_copy_(0, staging.get(idx), staging.get(values))
            del self._dirty[:num_lists]
            self._staged = None

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[R, width] int32 on the device: the tables of the step's requests (rows [R] int64 on the device)."""
        return self.device_table[:, :width].index_select(0, rows)

    def _mark(self, row: int, start: int, end: int) -> None:
        if end > start:
            base = row * self.host.shape[1]
            self._dirty.append(np.arange(base + start, base + end, dtype=np.int64))

    def _resize(self, rows: int, width: int) -> None:
        old_rows, old_width = self.host.shape
        host = np.zeros((rows, width), dtype=np.int32)
        host[:old_rows, :old_width] = self.host
        table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        if self._dirty:       # diffs not yet on the device: send the whole table instead (dirty indices are stale)
            self._dirty = [np.arange(rows * width, dtype=np.int64)[host.reshape(-1) != 0]]
        else:
            table[:old_rows, :old_width] = self.device_table      # device to device
        self.host, self.device_table = host, table
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(rows - old_rows, np.int32)])
        self.free_rows = list(range(rows - 1, old_rows - 1, -1)) + self.free_rows
