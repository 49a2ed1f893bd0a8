"""A packed weight assembled from row chunks packed one at a time (to_packed on a chunk of 16-row groups), written
in place into tensors of the whole weight's size: the decode and layout temporaries stay a chunk's (several bytes
a weight each: an output table of 128256 x 4096 would otherwise take ~3 GB of them at once).

Every form groups 16 output rows first, so a chunk of rows [r0, r1) is a contiguous run of row groups: qs, d and m
along their group axis (axis 1 of Q4_K / Q5_K's stacked [2, N/16, ...] d and m, else axis 0); Q5_K / Q6_K's 1-D
qs is two planes (nibbles, then the high bits), each holding row groups in order.
"""

from __future__ import annotations

import torch

from steploop.gpu_worker.cpu_kernels.packed_weights import GROUP, Q4_K, Q5_K, Q6_K, PackedWeight

_PLANES = {Q5_K: (4, 1), Q6_K: (4, 2)}               # bits a weight in each qs plane
_STACKED_SCALES = (Q4_K, Q5_K)                      # d, m: [2, N/16, ...]


def _empty_like_rows(t: torch.Tensor, axis: int, groups: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[axis] = groups
    return torch.empty(shape, dtype=t.dtype)


class RowAssembler:
    """Fill a PackedWeight of n rows chunk by chunk, in row order: add(chunk) for each, then weight()."""

    def __init__(self, n: int):
        self.n, self.row = n, 0
        self.out: dict[str, torch.Tensor | None] | None = None
        self.kind = self.k = None

    def add(self, chunk: PackedWeight) -> None:
        rows, k = chunk.out_features, chunk.in_features
        if self.out is None:
            self.kind, self.k = chunk.kind, k
            self.out = {name: None if t is None else self._alloc(name, t)
                        for name, t in (("qs", chunk.qs), ("d", chunk.d), ("m", chunk.m))}
        if chunk.kind != self.kind or k != self.k or rows % GROUP or self.row + rows > self.n:
            raise ValueError(f"row chunk {chunk.kind} [{rows}, {k}] does not fit the weight being assembled "
                             f"({self.kind} [{self.n}, {self.k}], {self.row} rows filled)")
        g0, groups = self.row // GROUP, rows // GROUP
        for name, src in (("qs", chunk.qs), ("d", chunk.d), ("m", chunk.m)):
            if src is None:
                continue
            if name == "qs" and self.kind in _PLANES:
                self._copy_planes(src, rows)
            else:
                self.out[name].narrow(self._axis(name), g0, groups).copy_(src)
        self.row += rows

    def weight(self) -> PackedWeight:
        if self.out is None or self.row != self.n:
            raise ValueError(f"{self.row} of {self.n} rows assembled")
        return PackedWeight(self.kind, self.out["qs"], self.out["d"], self.out["m"], self.n, self.k)

    def _axis(self, name: str) -> int:
        return 1 if name != "qs" and self.kind in _STACKED_SCALES else 0

    def _alloc(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "qs" and self.kind in _PLANES:
            return torch.empty(self.n * self.k * sum(_PLANES[self.kind]) // 8, dtype=t.dtype)
        return _empty_like_rows(t, self._axis(name), self.n // GROUP)

    def _copy_planes(self, src: torch.Tensor, rows: int) -> None:
        """Each plane's bytes of rows [row, row + rows) are one run: a row holds k * bits / 8 of them."""
        src_at, dst_at = 0, 0
        for bits in _PLANES[self.kind]:
            per_row = self.k * bits // 8
            self.out["qs"][dst_at + self.row * per_row:dst_at + (self.row + rows) * per_row].copy_(
                src[src_at:src_at + rows * per_row])
            src_at += rows * per_row
            dst_at += self.n * per_row
