"""Decoded GGUF blocks (blocks.py) -> the packed kernels' forms (cpu_kernels/packed_weights.py), without going
through fp32 weights:

    Q4_K                                       -> Q4_K form   (as stored: 4-bit q, 6-bit scale / min: 4.75 bits)
    Q5_K (and Q4_K fused with it)              -> Q5_K form   (as stored, with a fifth-bit plane: 5.75 bits)
    Q6_K                                       -> Q6_K form   (as stored: 4 + 2 bit planes, int8 scale per 16: 6.6 bits)
    Q4_0, Q4_1 (and Q4_K fused with these)     -> Q4_1 form   (uint8 nibbles, fp32 d and m per 32: 6 bits a weight)
    Q8_0, Q5_0                                 -> Q8_0 form   (int8, fp32 d per 32: 9 bits)
    Q5_1                                       -> Q8_1 form   (int8, fp32 d and m per 32: 10 bits)

A fused layer (q/k/v, gate/up) whose parts came in different types takes the narrowest form that holds them all:
Q4_K values are Q5_K values with a zero fifth bit; k-quants that no one k-quant form holds (Q4_K_M's q, k in Q4_K
with v in Q6_K) stay in their own forms as a SPLIT weight, each run of consecutive parts by its kernel (the int8
Q8_1/16 that holds them all read 12 bits a weight, 2.4x Q4_K's, at half Q4_K's speed at one row); otherwise Q8_1
when all have blocks of 32, else Q8_1/16 (or Q8_0/16 when none has an m). Every form computes w = d * q + m with
the parts' own d, q, m (the k-quant forms: their own two scale levels), so the values stay the file's.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from steploop.gpu_worker.cpu_kernels.packed_weights import (
    GROUP,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_0_16,
    Q8_1,
    Q8_1_16,
    Q8B_BLOCK,
    SPLIT,
    PackedWeight,
)
from steploop.gpu_worker.gguf.blocks import Decoded

# the int8/nibble form each type falls back to when fused with a type its own k-quant form cannot hold
FORM = {T.Q4_0: Q4_1, T.Q4_1: Q4_1, T.Q4_K: Q4_1, T.Q8_0: Q8_0, T.Q5_0: Q8_0, T.Q5_1: Q8_1, T.Q5_K: Q8_1,
        T.Q6_K: Q8_0_16}
_BLOCK = {Q4_1: 32, Q8_0: 32, **Q8B_BLOCK}
_HAS_M = {Q4_1: True, Q8_0: False, Q8_1: True, Q8_0_16: False, Q8_1_16: True}
_K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def common_form(qtypes: list[T]) -> int:
    if all(t in _K_QUANTS for t in qtypes):
        form = _k_form(qtypes)
        return SPLIT if form is None else form
    forms = {FORM[t] for t in qtypes}
    if len(forms) == 1:
        return forms.pop()
    if all(_BLOCK[f] == 32 for f in forms):
        return Q8_1
    return Q8_1_16 if any(_HAS_M[f] for f in forms) else Q8_0_16


def runs(qtypes: list[T]) -> list[tuple[int, int, int]]:
    """(first part, end part, form) of each run of consecutive k-quant parts one k-quant form holds, in order"""
    out: list[tuple[int, int, int]] = []
    for i, t in enumerate(qtypes):
        joined = _k_form(qtypes[out[-1][0]:i + 1]) if out else None
        if joined is None:
            out.append((i, i + 1, _k_form([t])))
        else:                        # part i joins the run before it
            out[-1] = (out[-1][0], i + 1, joined)
    return out


def _k_form(qtypes: list[T]) -> int | None:
    """The one k-quant form that holds all these types, or None"""
    if all(t == T.Q4_K for t in qtypes):
        return Q4_K
    if all(t in (T.Q4_K, T.Q5_K) for t in qtypes):
        return Q5_K
    return Q6_K if all(t == T.Q6_K for t in qtypes) else None


def _scales(parts: list[Decoded], block: int, m: bool) -> np.ndarray:
    out = []
    for p in parts:
        s = (p.m if p.m is not None else np.zeros_like(p.d)) if m else p.d
        out.append(np.repeat(s, p.block // block, axis=1) if p.block != block else s)
    return np.concatenate(out, axis=0)


def _grouped(scales: np.ndarray) -> torch.Tensor:
    """[N, K/B] -> [N/16, K/B, 16]"""
    n, nb = scales.shape
    return torch.from_numpy(np.ascontiguousarray(scales.reshape(n // GROUP, GROUP, nb).transpose(0, 2, 1)))


def _q4_k(parts: list[Decoded], q: np.ndarray) -> PackedWeight:
    n, k = q.shape
    sc, mn, d, dmin = (np.concatenate([p.k4[i] for p in parts], axis=0) for i in range(4))
    pairs = q.astype(np.uint8, copy=False).reshape(n // GROUP, GROUP, k // 2, 2).transpose(0, 2, 1, 3)
    qs = torch.from_numpy(np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)))
    return PackedWeight(Q4_K, qs, torch.stack([_grouped(d.astype(np.float32)), _grouped(dmin.astype(np.float32))]),
                        torch.stack([_grouped(sc.astype(np.uint8, copy=False)), _grouped(mn.astype(np.uint8, copy=False))]), n, k)


def _interleaved_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """[N, K] values < 2**bits -> [N/16, K/per, 16] bytes, per = 8 / bits consecutive k in a byte, lowest k in the
    lowest bits (the nibble plane is bits 4: k even low, k odd high)"""
    n, k = q.shape
    per = 8 // bits
    grouped = q.astype(np.uint8, copy=False).reshape(n // GROUP, GROUP, k // per, per).transpose(0, 2, 1, 3)
    out = np.zeros(grouped.shape[:3], np.uint8)
    for j in range(per):
        out |= grouped[..., j] << np.uint8(bits * j)
    return out


def _q5_k(parts: list[Decoded], q: np.ndarray) -> PackedWeight:
    """Q4_K and Q5_K parts: nibbles then fifth bits; the Q4_K form's scales"""
    n, k = q.shape
    q = q.astype(np.uint8, copy=False)
    planes = np.concatenate([_interleaved_bits(q & 15, 4).reshape(-1), _interleaved_bits(q >> 4, 1).reshape(-1)])
    sc, mn, d, dmin = (np.concatenate([p.k4[i] for p in parts], axis=0) for i in range(4))
    return PackedWeight(Q5_K, torch.from_numpy(planes),
                        torch.stack([_grouped(d.astype(np.float32)), _grouped(dmin.astype(np.float32))]),
                        torch.stack([_grouped(sc.astype(np.uint8)), _grouped(mn.astype(np.uint8))]), n, k)


def _q6_k(parts: list[Decoded], q: np.ndarray) -> PackedWeight:
    """Q6_K parts: nibbles then two high bits of q + 32 (0..63); int8 scale per 16, fp32 d per 256"""
    n, k = q.shape
    u = (q.astype(np.int16) + 32).astype(np.uint8)
    planes = np.concatenate([_interleaved_bits(u & 15, 4).reshape(-1), _interleaved_bits(u >> 4, 2).reshape(-1)])
    sc, d = (np.concatenate([p.k6[i] for p in parts], axis=0) for i in range(2))
    return PackedWeight(Q6_K, torch.from_numpy(planes), _grouped(d.astype(np.float32)),
                        _grouped(sc.astype(np.int8)), n, k)


def to_packed(parts: list[Decoded], kind: int, qtypes: list[T] | None = None) -> PackedWeight:
    """The parts' rows stacked in order (each a whole number of 16-row groups) in the form `kind` (SPLIT: the
    parts' types `qtypes` say which runs of parts go together)."""
    if kind == SPLIT:
        if qtypes is None:
            raise ValueError("to_packed: a SPLIT weight needs its parts' types")
        return PackedWeight.split([to_packed(parts[a:b], form) for a, b, form in runs(qtypes)])
    q = np.concatenate([p.q for p in parts], axis=0) if len(parts) > 1 else parts[0].q    # no copy for one part
    n, k = q.shape
    if kind == Q4_K:
        return _q4_k(parts, q)
    if kind == Q5_K:
        return _q5_k(parts, q)
    if kind == Q6_K:
        return _q6_k(parts, q)
    block, has_m = _BLOCK[kind], _HAS_M[kind]
    d = _grouped(_scales(parts, block, False))
    m = _grouped(_scales(parts, block, True)) if has_m else None
    if kind == Q4_1:
        pairs = q.astype(np.uint8, copy=False).reshape(n // GROUP, GROUP, k // 2, 2).transpose(0, 2, 1, 3)
        qs = torch.from_numpy(np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)))
    else:
        qs = torch.from_numpy(np.ascontiguousarray(q.astype(np.int8, copy=False).reshape(n // GROUP, GROUP, k).transpose(0, 2, 1)))
    return PackedWeight(kind, qs, d, m, n, k)
