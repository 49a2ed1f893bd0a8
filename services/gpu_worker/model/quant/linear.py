"""QuantLinear: a linear layer whose weight stays in its checkpoint's quantized form (never an fp32 copy at rest).

It is built in place of a model's fused linear (qkv_proj = q, k, v; gate_up_proj = gate, up), one part per
checkpoint linear; after loading, consecutive parts that can share one computation are merged into a segment:

    C packed    int4 groups -> Q4_1, symmetric int8 -> Q8_0 (packing.py), run by packed_linear.c on the CPU in fp32;
                act-order parts permute their input first. A layer that is one unpermuted packed segment exposes it
                as `.packed`, so the C whole-step decoder (decoder.c) reads it as it reads GGUF weights.
    triton int4 CUDA: int4 groups in the W4A16 Triton GEMM (kernels/w4a16.py), act-order input permuted first
    torch int   the reference formula per call (one layer's weight dequantized at a time): int8 on CUDA, asymmetric
                int8, shapes off the C layout
    fp8         FP8 W8A8, torch on the CPU, kernels/fp8_w8a8.py's Triton GEMM on CUDA: activations quantized to
                e4m3 per token (scale = amax / 448, as compressed-tensors' dynamic token quantization and vLLM's
                per-token scaled_fp8_quant), e4m3 x e4m3 products summed in fp32, times both scales
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import KIND_NAMES, PackedWeight
from steploop.gpu_worker.model.quant.formats import Fp8Weight, IntWeight, dequantize
from steploop.gpu_worker.model.quant.packing import concat, contiguous_groups, pack_int, packable

FP8_MAX = 448.0                                     # float8_e4m3fn's largest finite value
_EPS = torch.finfo(torch.float32).eps               # compressed-tensors' scale for an all-zero token


def quantize_fp8_per_token(x: torch.Tensor, reduce_max=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], fp32 scale [T, 1]) with x ~ q * scale, as compressed-tensors' dynamic "token"
    strategy: scale = amax / 448 (eps where a row is all zero), q = clamp(x / scale, +-448) cast to e4m3.
    reduce_max: a row-parallel layer's K is split over ranks; the per-token amax is over the whole row, so each
    rank's is all-reduced (max) first and every rank quantizes with the scale one rank would use."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = (amax if reduce_max is None else reduce_max(amax)) / FP8_MAX
    scale = torch.where(scale == 0, torch.tensor(_EPS), scale)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class _PackedSegment:
    def __init__(self, packed: PackedWeight, perm: torch.Tensor | None):
        self.packed, self.perm = packed, perm        # perm [K] int32: input column of each packed column

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.perm is None else x.index_select(-1, self.perm)
        return kernel.packed_linear(x, self.packed, torch.get_num_threads())

    def joins(self, other: _PackedSegment) -> bool:
        """Whether other's rows can be stacked under these: same kind, same input permutation."""
        return self.packed.kind == other.packed.kind and _same(self.perm, other.perm)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.perm is None else self.perm.numel() * 4)

    def describe(self) -> str:
        return KIND_NAMES[self.packed.kind] + (" act-order" if self.perm is not None else "")


class _TritonInt4Segment:
    """CUDA: the W4A16 Triton GEMM (kernels/w4a16.py) on the stored nibbles, group scales and zeros."""

    def __init__(self, w: IntWeight, perm: torch.Tensor | None, device: torch.device):
        from steploop.gpu_worker.kernels.w4a16 import Int4Gpu
        self.weight = Int4Gpu(w).to(device)
        self.perm = None if perm is None else perm.to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from steploop.gpu_worker.kernels.w4a16 import w4a16_linear
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if self.perm is None else x2.index_select(-1, self.perm)
        return w4a16_linear(x2, self.weight).view(*lead, -1)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.perm is None else self.perm.numel() * 4)

    def describe(self) -> str:
        return "int4 triton" + (" act-order" if self.perm is not None else "")


class _TorchSegment:
    def __init__(self, weight: IntWeight | Fp8Weight):
        self.weight = weight
        self.reduce_max = None       # FP8 on a row-parallel rank: the group's all-reduce (max) of the token amax

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, Fp8Weight):
            lead = x.shape[:-1]
            q, scale = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]), self.reduce_max)
            if x.is_cuda:        # the Triton GEMM on the e4m3 bytes (kernels/fp8_w8a8.py)
                from steploop.gpu_worker.kernels.fp8_w8a8 import fp8_w8a8_linear
                return fp8_w8a8_linear(q, scale, w.weight, w.scale, x.dtype).view(*lead, -1)
            y = (q.float() @ w.weight.float().T) * scale * w.scale.T
            return y.to(x.dtype).view(*lead, -1)
        return F.linear(x, dequantize(w).to(x.dtype))

    def joins(self, other: _TorchSegment) -> bool:
        """FP8 parts stack (each token's activation scale is the same for all of them); int parts stay apart."""
        return isinstance(self.weight, Fp8Weight) and isinstance(other.weight, Fp8Weight)

    def join(self, other: _TorchSegment) -> _TorchSegment:
        a, b = self.weight, other.weight
        rows = lambda w: w.scale.expand(w.weight.shape[0], 1)
        return _TorchSegment(Fp8Weight(torch.cat([a.weight, b.weight]), torch.cat([rows(a), rows(b)])))

    @property
    def nbytes(self) -> int:
        w = self.weight
        ts = (w.weight, w.scale) if isinstance(w, Fp8Weight) else (w.q, w.scale, w.zero, w.g_idx)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def describe(self) -> str:
        return "fp8 torch" if isinstance(self.weight, Fp8Weight) else f"int{self.weight.bits} torch"


class QuantLinear(nn.Module):
    packed: PackedWeight | None = None     # the whole layer as one unpermuted packed weight (the C decoder reads it)

    def __init__(self, in_features: int, out_features: int, bias: bool, parts: list[str]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.parts = parts                                      # checkpoint linear names, in row order
        self.loaded: dict[str, IntWeight | Fp8Weight] = {}      # filled while loading, emptied by finish()
        self.segments: list[_PackedSegment | _TorchSegment] = []

    def finish(self, device: torch.device, use_c: bool) -> None:
        """All parts loaded: build the segments on `device` (use_c: the C packed kernel serves what it can)."""
        missing = [p for p in self.parts if p not in self.loaded]
        if missing:
            raise ValueError(f"checkpoint is missing quantized weights for {missing}")
        if sum(self.loaded[p].weight.shape[0] if isinstance(self.loaded[p], Fp8Weight)
               else self.loaded[p].q.shape[0] for p in self.parts) != self.out_features:
            raise ValueError(f"{self.parts}: rows do not add up to {self.out_features}")
        for part in self.parts:
            segment = _segment(self.loaded.pop(part), device, use_c)
            last = self.segments[-1] if self.segments else None
            if isinstance(segment, _PackedSegment) and isinstance(last, _PackedSegment) and last.joins(segment):
                self.segments[-1] = _PackedSegment(concat([last.packed, segment.packed]), last.perm)
            elif isinstance(segment, _TorchSegment) and isinstance(last, _TorchSegment) and last.joins(segment):
                self.segments[-1] = last.join(segment)
            else:
                self.segments.append(segment)
        if len(self.segments) == 1 and isinstance(self.segments[0], _PackedSegment) and self.segments[0].perm is None:
            self.packed = self.segments[0].packed

    def split_input(self, reduce_max) -> None:
        """A row-parallel rank's layer: its FP8 activations take the whole row's scale (quantize_fp8_per_token)."""
        for segment in self.segments:
            if isinstance(segment, _TorchSegment):
                segment.reduce_max = reduce_max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.segments) == 1:
            y = self.segments[0](x)
        else:
            y = torch.cat([segment(x) for segment in self.segments], dim=-1)
        return y if self.bias is None else y.add_(self.bias)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def extra_repr(self) -> str:
        kinds = " + ".join(s.describe() for s in self.segments) or "not loaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _segment(w: IntWeight | Fp8Weight, device: torch.device, use_c: bool):
    if device.type == "cuda" and isinstance(w, IntWeight) and w.bits == 4 and w.q.shape[1] % 8 == 0 and \
            w.group_size > 0:    # 0: act-order groups split unevenly by -tp (quant/shards.py): torch
        plain, perm = contiguous_groups(w)
        return _TritonInt4Segment(plain, perm, device)
    if use_c and isinstance(w, IntWeight):
        plain, perm = contiguous_groups(w)
        if packable(plain):
            return _PackedSegment(pack_int(plain), perm)
    return _TorchSegment(_to(w, device))


def _to(w: IntWeight | Fp8Weight, device: torch.device) -> IntWeight | Fp8Weight:
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight.to(device), w.scale.to(device))
    move = lambda t: None if t is None else t.to(device)
    return IntWeight(move(w.q), move(w.scale), move(w.zero), move(w.g_idx), w.group_size, w.bits)
