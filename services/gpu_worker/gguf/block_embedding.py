"""BlockEmbedding: a GGUF embedding table kept in its blocks (q, d, m per block of 16 or 32 along the row); a lookup
dequantizes only the rows it reads. An fp32 table is the largest single weight of a small model (49152 x 576 x 4 B =
113 MB for the default model; 2.1 GB for a Llama-3.1-8B) against ~6-10 bits a weight here.

Each looked-up value is d * q + m computed as gguf-py computes it: the product exact, one rounding for the sum
(torch's separate mul and add on the CPU), so the rows are the file's dequantized values.
"""

from __future__ import annotations

import torch
from torch import nn

from steploop.gpu_worker.gguf.blocks import Decoded


class BlockEmbedding(nn.Module):
    def __init__(self, decoded: Decoded):
        super().__init__()
        q = torch.from_numpy(decoded.q.copy())
        self.nibbles = q.dtype == torch.uint8              # 4-bit values: two per byte (even k low)
        self.embedding_dim = q.shape[1]
        self.block = decoded.block
        self.register_buffer("q", (q[:, 0::2] | (q[:, 1::2] << 4)) if self.nibbles else q, persistent=False)
        self.register_buffer("d", torch.from_numpy(decoded.d.copy()), persistent=False)
        self.register_buffer("m", None if decoded.m is None else torch.from_numpy(decoded.m.copy()), persistent=False)

    @property
    def num_embeddings(self) -> int:
        return self.q.shape[0]

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
