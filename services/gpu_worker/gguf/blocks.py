"""A GGUF tensor's raw blocks -> its integer values and per-block fp32 scales, exactly as gguf-py's dequantize
computes them (gguf/quants.py): w = d * q (+ m) per block of `block` weights along a row.

    decoded = decode(raw, qtype, k)      # raw: uint8 [rows, row bytes] from the memory-mapped file
    decoded.q [rows, k] (uint8 0..15 for the 4-bit types, else int8), decoded.d / .m fp32 [rows, k / block]

The k-quants' two scale levels fold into one fp32 scale per sub-block: Q4_K / Q5_K d * sc and -(dmin * m) (6-bit
sc, m), Q6_K d * sc (int8 sc, 16 weights). Each product is exact in fp32 (fp16 d: 11 significant bits, times at
most 8), so d * q + m rounds once, as gguf-py's d * q - dm does: the packed kernels compute with the file's own
dequantized values. Q4_0 (q - 8) keeps q in 0..15 with m = -8 d (exact), so it runs in the Q4_1 form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

QK_K = 256
# the types read at their block width (the others: F32, F16, BF16, read as floats)
BLOCK_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED = FLOAT_TYPES + BLOCK_TYPES


@dataclass
class Decoded:
    q: np.ndarray               # [rows, k] uint8 (4-bit types) or int8
    d: np.ndarray               # fp32 [rows, k / block]
    m: np.ndarray | None        # fp32 [rows, k / block], or None (w = d * q)
    block: int                  # weights per scale: 32, or 16 (Q6_K)
    k4: tuple | None = None     # Q4_K / Q5_K's own scales: (sc, mn uint8 [rows, k/32], d, dmin fp32 [rows, k/256])
    k6: tuple | None = None     # Q6_K's own scales: (sc int8 [rows, k/16], d fp32 [rows, k/256])


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """[blocks, n/2 bytes] -> [blocks, n]: the low nibbles are the first n/2 weights, the high ones the next n/2"""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes of fifth bits -> [blocks, 32] bits (little-endian bit order)"""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block (gguf-py's get_scale_min)"""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(raw: np.ndarray, qtype: T, k: int) -> Decoded:
    """raw uint8 [rows, row bytes] of a BLOCK_TYPES tensor whose rows hold k weights."""
    rows = raw.shape[0]
    type_size = GGML_QUANT_SIZES[qtype][1]
    b = np.ascontiguousarray(raw).reshape(-1, type_size)
    if qtype == T.Q4_0:
        d = _f16(b[:, 0:2])[:, 0]
        q, dd, mm = _nibbles(b[:, 2:], 32), d, -8.0 * d
    elif qtype == T.Q4_1:
        q, dd, mm = _nibbles(b[:, 4:], 32), _f16(b[:, 0:2])[:, 0], _f16(b[:, 2:4])[:, 0]
    elif qtype == T.Q5_0:
        q5 = _nibbles(b[:, 6:], 32) | (_high_bits(b[:, 2:6]) << 4)
        q, dd, mm = (q5.astype(np.int16) - 16).astype(np.int8), _f16(b[:, 0:2])[:, 0], None
    elif qtype == T.Q5_1:
        q5 = _nibbles(b[:, 8:], 32) | (_high_bits(b[:, 4:8]) << 4)
        q, dd, mm = q5.astype(np.int8), _f16(b[:, 0:2])[:, 0], _f16(b[:, 2:4])[:, 0]
    elif qtype == T.Q8_0:
        q, dd, mm = b[:, 2:].view(np.int8), _f16(b[:, 0:2])[:, 0], None
    elif qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])                   # [blocks, 1]
        sc, mn = _scale_min_k4(b[:, 4:16])
        k4 = (sc.reshape(rows, -1), mn.reshape(rows, -1), d.reshape(rows, -1), dmin.reshape(rows, -1))
        dd = (d * sc.astype(np.float32)).reshape(-1)                  # per 32-weight sub-block
        mm = -(dmin * mn.astype(np.float32)).reshape(-1)
        if qtype == T.Q4_K:
            q = np.concatenate([_nibbles(qs, 64) for qs in np.split(b[:, 16:], 4, axis=-1)], axis=-1)
        else:
            qh = b[:, 16:48]                                          # bit j of byte i: weight 32 j + i
            ql = np.concatenate([_nibbles(qs, 64) for qs in np.split(b[:, 48:], 4, axis=-1)], axis=-1)
            hi = np.concatenate([(qh >> j) & 1 for j in range(8)], axis=-1)
            q = (ql | (hi << 4)).astype(np.int8)
    elif qtype == T.Q6_K:
        ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        lo = np.concatenate([_nibbles(half, 64) for half in np.split(ql, 2, axis=-1)], axis=-1)  # [blocks, 256]
        hi = np.concatenate([np.concatenate([(half >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
                             for half in np.split(qh, 2, axis=-1)], axis=-1)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
        dd = (d * scales.view(np.int8).astype(np.float32)).reshape(-1)
        mm = None
        k6 = (scales.view(np.int8).reshape(rows, -1), d.reshape(rows, -1))
    else:
        raise ValueError(f"GGUF type {qtype.name} is not read at its block width")
    block = 16 if qtype == T.Q6_K else 32
    q = np.ascontiguousarray(q).reshape(rows, k)
    return Decoded(q, np.asarray(dd, np.float32).reshape(rows, k // block),
                   None if mm is None else np.asarray(mm, np.float32).reshape(rows, k // block), block,
                   k4 if qtype in (T.Q4_K, T.Q5_K) else None, k6 if qtype == T.Q6_K else None)


def dequantize(decoded: Decoded) -> np.ndarray:
    """fp32 [rows, k] (tests; layers the kernels cannot hold): d * q (+ m) per block, one rounding"""
    rows, k = decoded.q.shape
    q = decoded.q.astype(np.float32).reshape(rows, k // decoded.block, decoded.block)
    w = decoded.d[..., None] * q
    if decoded.m is not None:
        w = w + decoded.m[..., None]
    return w.reshape(rows, k)

