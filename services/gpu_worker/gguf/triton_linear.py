"""A GGUF file's block-quantized linear for the Triton GEMM (kernels/gguf_gemm.py): the GPU's counterpart of the CPU's
packed forms, held at about the file's width instead of widened to bf16.

    GgufBlocks     one run of rows in one form (nibbles or int8, 16- or 32-weight blocks, with or without m),
                   built from gguf/blocks.py's decode a chunk of rows at a time, on the device
    GgufLinear     an nn.Linear whose weight is a list of GgufBlocks stacked by rows (Q4_K_M's q, k in Q4_K and v in
                   Q6_K are two runs); its bias, if any, stays the module's own parameter

Bits per weight held: 4-bit types 4 + 64 / 32 = 6 (two fp32 per 32 weights), Q8_0 / Q5_0 8 + 1, Q5_1 / Q5_K
8 + 2, Q6_K 8 + 2 (one fp32 per 16): against 16 for bf16.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from steploop.gpu_worker.gguf.blocks import Decoded


class GgufBlocks:
    """q [K/2, N] uint8 (nibbles) or [K, N] int8, d and m [K/block, N] fp32 (m None: w = d * q)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, block: int):
        self.q, self.d, self.m, self.block = q, d, m, block

    @staticmethod
    def form(decoded: Decoded) -> tuple[bool, int, bool]:
        """(nibbles, block, has m): pieces of one form stack into one GgufBlocks."""
        return decoded.q.dtype == np.uint8, decoded.block, decoded.m is not None

    @classmethod
    def from_decoded(cls, pieces: list[Decoded], device: torch.device) -> GgufBlocks:
        """Row chunks of one form, in order, as one run of rows on the device."""
        nibbles, block, has_m = cls.form(pieces[0])
        qs, ds, ms = [], [], []
        for p in pieces:
            if cls.form(p) != (nibbles, block, has_m):
                raise ValueError("GgufBlocks.from_decoded: pieces of different forms")
            q = torch.from_numpy(np.ascontiguousarray(p.q.T))                               # [K, rows]
            if nibbles:
                q = q[0::2] | (q[1::2] << 4)                                                  # [K/2, rows]
            qs.append(q.to(device))
            ds.append(torch.from_numpy(np.ascontiguousarray(p.d.T)).to(device))
            if has_m:
                ms.append(torch.from_numpy(np.ascontiguousarray(p.m.T)).to(device))
        return cls(torch.cat(qs, 1).contiguous(), torch.cat(ds, 1).contiguous(),
                   torch.cat(ms, 1).contiguous() if has_m else None, block)

    @property
    def out_features(self) -> int:
        return self.q.shape[1]

    @property
    def in_features(self) -> int:
        return self.q.shape[0] * (2 if self.q.dtype == torch.uint8 else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def describe(self) -> str:
        return f"{'int4' if self.q.dtype == torch.uint8 else 'int8'}/{self.block}{'+m' if self.m is not None else ''}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from steploop.gpu_worker.kernels.gguf_gemm import gguf_gemm
        return gguf_gemm(x, self.q, self.d, self.m, self.block)

    def dequantized(self) -> torch.Tensor:
        """[N, K] fp32 (tests): d * q (+ m), as gguf-py rounds."""
        q = self.q
        if q.dtype == torch.uint8:
            q = torch.stack([q & 15, q >> 4], 1).reshape(-1, q.shape[1])
        rows = torch.arange(q.shape[0], device=q.device) // self.block
        w = self.d[rows] * q.float()
        return (w if self.m is None else w + self.m[rows]).T


class GgufLinear(nn.Linear):
    """y = x W^T (+ b) with W the runs of GgufBlocks stacked by rows; no weight parameter."""

    def __init__(self, runs: list[GgufBlocks], bias: nn.Parameter | None):
        n, k = sum(r.out_features for r in runs), runs[0].in_features
        nn.Module.__init__(self)
        self.in_features, self.out_features = k, n
        self.weight = None
        self.bias = bias                   # the replaced layer's own parameter (filled before or after)
        self.runs = runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.runs[0](flat) if len(self.runs) == 1 else torch.cat([r(flat) for r in self.runs], dim=-1)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{' + '.join(r.describe() for r in self.runs)}")
