"""Lossless packing of fp32 weights that came from GGUF block quantization (Q4_1, Q8_0), for packed_linear.c.

A checkpoint dequantized from GGUF holds, per block of 32 weights along K, exactly
    Q4_1: w = d * q + m,  q in 0..15,      d, m fp16 values (llama.cpp sets m to the block minimum: q = 0 there)
    Q8_0: w = d * q,      q in -127..127,  d an fp16 value (the block's largest |w| has |q| = 127)
pack() recovers (d, m, q) from the fp32 values and keeps the result only when d * q + m gives back every weight bit
for bit, so the kernel computes with the checkpoint's own numbers. Weights that never were quantized fail the check
and stay fp32. The layout groups 16 output rows so one vector load reads one k of 16 rows (see packed_linear.c).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32          # weights per block along K
GROUP = 16       # output rows per layout group
Q4_1, Q8_0 = 0, 1
# GGUF types read straight from the file (gpu_worker/gguf/) that the two forms above cannot hold, run by
# packed_linear.c's steploop_packed_linear_q8b: int8 q per weight, fp32 d (and m) per block of 32 or 16
# (Q8_1/16: a fused layer whose parts mix Q6_K with a type that has m, e.g. Q4_K_M's q, k (Q4_K) and v (Q6_K))
# Q4_K: GGUF Q4_K at its width (steploop_packed_linear_q4k): qs as Q4_1's; d = fp32 [2, N/16, K/256, 16] (d, dmin
# per super-block), m = uint8 [2, N/16, K/32, 16] (6-bit scale, min per 32); w = d sc q - dmin mn
# Q5_K, Q6_K: GGUF Q5_K / Q6_K at their width (steploop_packed_linear_kquant): qs uint8 1-D, the nibble plane
# [N/16, K/2, 16] as Q4_1's, then the high bits ([N/16, K/8, 16] fifth bits / [N/16, K/4, 16] two bits a weight).
# Q5_K: d and m as Q4_K's; w = d sc q - dmin mn. Q6_K: d = fp32 [N/16, K/256, 16], m = int8 sc [N/16, K/16, 16];
# w = d sc (q - 32)
# SPLIT: rows in consecutive parts of different forms (`parts`, e.g. Q4_K_M's q, k in Q4_K then v in Q6_K), each run
# by its own kernel into its columns of y: one form holding them all (the int8 Q8_1/16) read 12 bits a weight
# BF16, F16: a 16-bit checkpoint's weights kept at their width (steploop_packed_linear_w16): qs int16 [N/16, K, 16]
# holding the stored bits, widened exactly to fp32 in the kernel; no d or m (empty), any K
Q8_1, Q8_0_16, Q8_1_16, Q4_K, Q5_K, Q6_K, SPLIT, BF16, F16 = 200, 201, 202, 203, 204, 205, 206, 207, 208
KIND_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0", Q8_1: "Q8_1", Q8_0_16: "Q8_0/16", Q8_1_16: "Q8_1/16", Q4_K: "Q4_K",
              Q5_K: "Q5_K", Q6_K: "Q6_K", SPLIT: "split", BF16: "bf16", F16: "fp16"}
W16_KINDS = {torch.bfloat16: BF16, torch.float16: F16}
W16_DTYPES = {kind: dtype for dtype, kind in W16_KINDS.items()}    # a 16-bit form's stored dtype
Q8B_BLOCK = {Q8_1: 32, Q8_0_16: 16, Q8_1_16: 16}     # weights per d (and m) along K


@dataclass
class PackedWeight:
    kind: int
    qs: torch.Tensor          # Q4_1: uint8 [N/16, K/2, 16] (k even low nibble); Q8_*: int8 [N/16, K, 16]
    d: torch.Tensor           # fp32 [N/16, K/B, 16], B = 32 (Q8_0/16: 16)
    m: torch.Tensor | None    # fp32, as d (Q4_1, Q8_1 and Q8_1/16 only)
    out_features: int
    in_features: int
    parts: list[PackedWeight] | None = None     # SPLIT only: the row blocks in order (qs, d: empty)

    @classmethod
    def split(cls, parts: list[PackedWeight]) -> PackedWeight:
        """Row blocks of different forms as one weight (one part: that part)."""
        if len(parts) == 1:
            return parts[0]
        empty = torch.empty(0)
        return cls(SPLIT, empty, empty, None, sum(p.out_features for p in parts), parts[0].in_features, list(parts))

    def describe(self) -> str:
        """The form's name; a split weight's parts' names joined by +"""
        return "+".join(p.describe() for p in self.parts) if self.parts else KIND_NAMES[self.kind]

    @property
    def m_or_d(self) -> torch.Tensor:
        """The kernel's m argument: Q8_0 has no m, and d stands in (the kernel does not read it)."""
        return self.m if self.m is not None else self.d

    @property
    def nbytes(self) -> int:
        if self.parts:
            return sum(p.nbytes for p in self.parts)
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32) == b.view(torch.int32)).all(-1)


def _is_fp16(t: torch.Tensor) -> bool:
    return torch.equal(t.half().float(), t)


def _fp16_candidates(d: torch.Tensor) -> list[torch.Tensor]:
    """fp16 values at and next to d: llama.cpp rounds d to fp16 from values we no longer have."""
    bits = d.half().view(torch.int16)
    return [(bits + step).clamp(min=0).view(torch.float16).float() for step in (0, 1, -1, 2, -2)]


def _recover_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    m = blocks.amin(-1)
    if not _is_fp16(m):
        return None
    q_out = torch.zeros(blocks.shape, dtype=torch.uint8)
    d_out = torch.zeros_like(m)
    done = torch.zeros(m.shape, dtype=torch.bool)
    offset = blocks - m[..., None]
    for d in _fp16_candidates((blocks.amax(-1) - m) / 15):
        positive = d > 0
        q = torch.where(positive[..., None], torch.round(offset / torch.where(positive, d, 1.0)[..., None]),
                        0.0).clamp(0, 15).to(torch.uint8)              # checked as stored: integers
        ok = _same_bits(d[..., None] * q.float() + m[..., None], blocks) & ~done
        q_out[ok], d_out[ok] = q[ok], d[ok]
        done |= ok
        if bool(done.all()):
            return q_out, d_out, m
    return None


def _recover_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    d = blocks.abs().amax(-1) / 127
    if not _is_fp16(d):
        return None
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)[..., None]).clamp(-127, 127).to(torch.int8)
    if not bool(_same_bits(d[..., None] * q.float(), blocks).all()):     # an integer q: no -0.0
        return None
    return q, d


def _grouped(scales: torch.Tensor) -> torch.Tensor:
    """[N, K/32] -> [N/16, K/32, 16]"""
    n, nb = scales.shape
    return scales.view(n // GROUP, GROUP, nb).permute(0, 2, 1).contiguous()


def packable_shape(n: int, k: int) -> bool:
    """Whether an [n, k] weight fits the layout: whole groups of output rows, whole blocks along K."""
    return n > 0 and n % GROUP == 0 and k % QK == 0


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """weight [N, K] fp32 -> its packed form (Q4_1 tried first), or None when it is not exactly either."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if not packable_shape(n, k):
        return None
    blocks = weight.detach().cpu().reshape(n, k // QK, QK)
    q4 = _recover_q4_1(blocks)
    if q4 is not None:
        q, d, m = q4
        pairs = q.view(n // GROUP, GROUP, k // 2, 2).permute(0, 2, 1, 3)      # [N/16, K/2, 16, (even, odd)]
        qs = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
        return PackedWeight(Q4_1, qs, _grouped(d), _grouped(m), n, k)
    q8 = _recover_q8_0(blocks)
    if q8 is not None:
        q, d = q8
        qs = q.view(n // GROUP, GROUP, k).permute(0, 2, 1).contiguous()       # [N/16, K, 16]
        return PackedWeight(Q8_0, qs, _grouped(d), None, n, k)
    return None


def w16_rows(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 / fp16 weight [n, K] (n a multiple of 16) -> its bits in the 16-bit layout, int16 [n/16, K, 16]: rows
    [r, r + n) of a layer fill groups [r/16, (r + n)/16) of its qs."""
    n, k = weight.shape
    return weight.contiguous().view(torch.int16).view(n // GROUP, GROUP, k).permute(0, 2, 1).contiguous()


def empty_w16(dtype: torch.dtype, n: int, k: int) -> PackedWeight:
    """A 16-bit packed weight [n, k] of `dtype` (bf16 / fp16) to fill with w16_rows, a part at a time."""
    empty = torch.empty(0)
    return PackedWeight(W16_KINDS[dtype], torch.empty(n // GROUP, k, GROUP, dtype=torch.int16), empty, None, n, k)


def pack_w16(weight: torch.Tensor) -> PackedWeight | None:
    """weight [N, K] bf16 / fp16 -> its 16-bit packed form, or None when N is not whole groups of 16 rows."""
    if weight.dtype not in W16_KINDS or weight.dim() != 2 or weight.shape[0] % GROUP or not weight.shape[0] \
            or not weight.shape[1]:
        return None
    packed = empty_w16(weight.dtype, *weight.shape)
    packed.qs.copy_(w16_rows(weight.detach().cpu()))
    return packed


def unpack(packed: PackedWeight) -> torch.Tensor:
    """The fp32 weight [N, K] back (tests and checks)."""
    n, k = packed.out_features, packed.in_features
    if packed.kind == SPLIT:
        return torch.cat([unpack(p) for p in packed.parts])
    if packed.kind in W16_DTYPES:
        return packed.qs.permute(0, 2, 1).reshape(n, k).view(W16_DTYPES[packed.kind]).float()
    if packed.kind in (Q4_K, Q5_K):
        d, dmin = (t.permute(0, 2, 1).reshape(n, k // 256, 1).repeat_interleave(8, 1) for t in packed.d)
        sc, mn = (t.permute(0, 2, 1).reshape(n, k // QK, 1).float() for t in packed.m)
        q = _nibble_plane(packed).reshape(n, k // QK, QK).float()
        if packed.kind == Q5_K:
            q = q + 16 * _high_plane(packed, 1).reshape(n, k // QK, QK).float()
        return (d * sc * q - dmin * mn).reshape(n, k)
    if packed.kind == Q6_K:
        d = packed.d.permute(0, 2, 1).reshape(n, k // 256, 1).repeat_interleave(16, 1)
        sc = packed.m.permute(0, 2, 1).reshape(n, k // 16, 1).float()
        q = (_nibble_plane(packed) | (_high_plane(packed, 2) << 4)).reshape(n, k // 16, 16).float() - 32
        return (d * sc * q).reshape(n, k)
    if packed.kind in Q8B_BLOCK:
        bs = Q8B_BLOCK[packed.kind]
        q = packed.qs.permute(0, 2, 1).reshape(n, k // bs, bs).float()
        w = packed.d.permute(0, 2, 1).reshape(n, k // bs, 1) * q
        if packed.m is not None:
            w = w + packed.m.permute(0, 2, 1).reshape(n, k // bs, 1)
        return w.reshape(n, k)
    d = packed.d.permute(0, 2, 1).reshape(n, k // QK, 1)
    if packed.kind == Q4_1:
        qs = packed.qs.permute(0, 2, 1).reshape(n, k // 2)                   # [N, K/2] bytes
        q = torch.stack([qs & 15, qs >> 4], dim=-1).reshape(n, k // QK, QK).float()
        m = packed.m.permute(0, 2, 1).reshape(n, k // QK, 1)
        return (d * q + m).reshape(n, k)
    q = packed.qs.permute(0, 2, 1).reshape(n, k // QK, QK).float()
    return (d * q).reshape(n, k)


def _nibble_plane(packed: PackedWeight) -> torch.Tensor:
    """Q5_K / Q6_K: the low four bits of every weight, [N, K] uint8"""
    n, k = packed.out_features, packed.in_features
    qs = packed.qs[:n * k // 2].view(n // GROUP, k // 2, GROUP).permute(0, 2, 1).reshape(n, k // 2)
    return torch.stack([qs & 15, qs >> 4], dim=-1).reshape(n, k)


def _high_plane(packed: PackedWeight, bits: int) -> torch.Tensor:
    """Q5_K (bits 1) / Q6_K (bits 2): the bits above the nibble of every weight, [N, K] uint8"""
    n, k = packed.out_features, packed.in_features
    per = 8 // bits
    hb = packed.qs[n * k // 2:].view(n // GROUP, k // per, GROUP).permute(0, 2, 1).reshape(n, k // per, 1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((hb >> shifts) & ((1 << bits) - 1)).reshape(n, k)
