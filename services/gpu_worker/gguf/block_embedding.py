"""BlockEmbedding: a GGUF embedding table kept in its blocks (q, d, m per block of 16 or 32 along the row); a lookup
dequantizes only the rows it reads. An fp32 table is the largest single weight of a small model (49152 x 576 x 4 B =
113 MB for the default model; 2.1 GB for a Llama-3.1-8B) against ~6-10 bits a weight here.

Each looked-up value is d * q + m computed as gguf-py computes it: the product exact, one rounding for the sum
(torch's separate mul and add on the CPU), so the rows are the file's dequantized values.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from steploop.gpu_worker.gguf.blocks import Decoded, decode


class BlockEmbedding(nn.Module):
    def __init__(self, decoded: Decoded, rows: int | None = None):
        """A table of `rows` (default: the decoded ones), the decoded rows first."""
        super().__init__()
        n, k = decoded.q.shape
        self._allocate(rows or n, k, decoded.block, decoded.q.dtype == np.uint8, decoded.m is not None)
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

    def _allocate(self, rows: int, k: int, block: int, nibbles: bool, has_m: bool) -> None:
        self.nibbles = nibbles                             # 4-bit values: two per byte (even k low)
        self.embedding_dim, self.block = k, block
        q_dtype = torch.uint8 if nibbles else torch.int8
        self.register_buffer("q", torch.empty(rows, k // 2 if nibbles else k, dtype=q_dtype), persistent=False)
        self.register_buffer("d", torch.empty(rows, k // block), persistent=False)
        self.register_buffer("m", torch.empty(rows, k // block) if has_m else None, persistent=False)

    def _fill(self, row: int, decoded: Decoded) -> None:
        q = torch.from_numpy(decoded.q)
        end = row + q.shape[0]
        self.q[row:end] = (q[:, 0::2] | (q[:, 1::2] << 4)) if self.nibbles else q
        self.d[row:end] = torch.from_numpy(decoded.d)
        if self.m is not None:
            self.m[row:end] = torch.from_numpy(decoded.m)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids]
        if self.nibbles:
            q = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)
        lead, k = ids.shape, self.embedding_dim
        w = q.float().view(*lead, k // self.block, self.block) * self.d[ids].unsqueeze(-1)
        if self.m is not None:
            w = w + self.m[ids].unsqueeze(-1)
        return w.view(*lead, k)

    def extra_repr(self) -> str:
        return f"{self.q.shape[0]}, {self.embedding_dim}, blocks of {self.block}" + (", 4-bit" if self.nibbles else "")
