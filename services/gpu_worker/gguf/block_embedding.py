"""BlockEmbedding: a GGUF embedding table kept in its blocks (q, d, m per block of 16 or 32 along the row); a lookup
dequantizes only the rows it reads. An fp32 table is the largest single weight of a small model (49152 x 576 x 4 B =
113 MB for the default model; 2.1 GB for a Llama-3.1-8B) against ~5-10 bits a weight here.

The k-quants keep their own two scale levels (Q4_K / Q5_K: 6-bit sc and mn per 32, fp32 d and dmin per 256; Q6_K:
int8 sc per 16, fp32 d per 256: 4.6 bits a weight for Q4_K instead of 6 with an fp32 d and m per 32); a lookup folds
them as blocks.decode does (d * sc, -(dmin * mn): exact products). Each looked-up value is d * q + m computed as
gguf-py computes it: the product exact, one rounding for the sum (torch's separate mul and add on the CPU), so the
rows are the file's dequantized values.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from steploop.gpu_worker.gguf.blocks import Decoded, decode


class BlockEmbedding(nn.Module):
    out_dtype = torch.float32     # the rows' dtype (a GPU model's bf16: the values rounded once, after d * q + m)

    def __init__(self, decoded: Decoded, rows: int | None = None):
        """A table of `rows` (default: the decoded ones), the decoded rows first."""
        super().__init__()
        n, k = decoded.q.shape
        self._allocate(rows or n, k, decoded)
        self._fill(0, decoded)

    @classmethod
    def from_blocks(cls, raw: np.ndarray, qtype, k: int, rows_per_chunk: int = 1024, done=None) -> "BlockEmbedding":
        """A table of raw blocks (uint8 [rows, row bytes]) decoded a chunk of rows at a time into the table's own
        tensors: the decode temporaries stay a chunk's (a 128256-row table's would be ~1.5 GB at once).
        done(r0, r1): called once rows [r0, r1) are read (the loader drops their file pages)."""
        rows = raw.shape[0]
        table = None
        for r in range(0, rows, rows_per_chunk):
            decoded = decode(raw[r:r + rows_per_chunk], qtype, k)
            if table is None:
                table = cls(decoded, rows=rows)
            else:
                table._fill(r, decoded)
            if done is not None:
                done(r, min(rows, r + rows_per_chunk))
        return table

    def _allocate(self, rows: int, k: int, decoded: Decoded) -> None:
        self.nibbles = decoded.q.dtype == np.uint8       # 4-bit values: two per byte (even k low)
        self.embedding_dim, self.block = k, decoded.block
        q_dtype = torch.uint8 if self.nibbles else torch.int8
        self.register_buffer("q", torch.empty(rows, k // 2 if self.nibbles else k, dtype=q_dtype), persistent=False)
        for name, a in self._sources(decoded).items():     # each [rows, per row]: one buffer of the table's rows
            self.register_buffer(name, None if a is None else torch.empty(rows, a.shape[1],
                                                                          dtype=torch.from_numpy(np.empty(0, a.dtype)).dtype),
                                 persistent=False)

    @staticmethod
    def _sources(decoded: Decoded) -> dict:
        """The scale arrays kept: the k-quants' own (sc, mn per sub-block; d, m = d, dmin per 256), else d, m."""
        if decoded.k4 is not None:
            sc, mn, d, dmin = decoded.k4
            return {"sc": sc, "mn": mn, "d": d, "m": dmin}
        if decoded.k6 is not None:
            sc, d = decoded.k6
            return {"sc": sc, "mn": None, "d": d, "m": None}
        return {"sc": None, "mn": None, "d": decoded.d, "m": decoded.m}

    def _fill(self, row: int, decoded: Decoded) -> None:
        q = torch.from_numpy(decoded.q)
        end = row + q.shape[0]
        self.q[row:end] = (q[:, 0::2] | (q[:, 1::2] << 4)) if self.nibbles else q
        for name, a in self._sources(decoded).items():
            if a is not None:
                getattr(self, name)[row:end] = torch.from_numpy(np.ascontiguousarray(a))

    def _scales(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """d, m per block of the looked-up rows [*ids, k / block], as blocks.decode folds them."""
        if self.sc is None:
            return self.d[ids], None if self.m is None else self.m[ids]
        per = self.sc.shape[1] // self.d.shape[1]               # sub-blocks per super-block of 256
        d = self.d[ids].repeat_interleave(per, -1) * self.sc[ids].float()
        m = None if self.mn is None else -(self.m[ids].repeat_interleave(per, -1) * self.mn[ids].float())
        return d, m

    @property
    def num_embeddings(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids]
        if self.nibbles:
            q = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)
        lead, k = ids.shape, self.embedding_dim
        d, m = self._scales(ids)
        w = q.float().view(*lead, k // self.block, self.block) * d.unsqueeze(-1)
        if m is not None:
            w = w + m.unsqueeze(-1)
        w = w.view(*lead, k)
        return w if self.out_dtype == torch.float32 else w.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.q.shape[0]}, {self.embedding_dim}, blocks of {self.block}" + (", 4-bit" if self.nibbles else "")
