"""Each format's tensors for one linear layer -> one common form, checked for shape before any value is used.

    IntWeight: w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]),  g = g_idx[k] (k // group_size without act-order)
    Fp8Weight: w[n, k] = float(weight[n, k]) * scale[n or 0]

The packings, as each format's own reference code writes and reads them (bits b = 4 or 8, 32 / b values per int32,
value i of a word at bits [b*i, b*i + b)):
  GPTQ (AutoGPTQ / optimum / GPTQModel, `dequantize_weight` in gptqmodel's torch QuantLinear):
      qweight int32 [K*b/32, N] packed along K; qzeros int32 [G, N*b/32] packed along N; scales [G, N]; g_idx [K].
      checkpoint_format "gptq" (v1) stores zero - 1: the reader adds 1 after masking (AutoGPTQ's `zeros + 1`).
  AWQ GEMM (AutoAWQ WQLinear_GEMM, `unpack_awq` + `reverse_awq_order`): qweight int32 [K, N/8] packed along N with
      the column order [0, 2, 4, 6, 1, 3, 5, 7] inside each word; qzeros int32 [G, N/8] the same; scales [G, N];
      w = (q - zero) * scale (no offset).
  compressed-tensors pack-quantized (`pack_to_int32` / `unpack_from_int32`): weight_packed int32 [N, K*b/32] packed
      along K, signed values stored + 2^(b-1); weight_scale [N, G]; weight_zero_point (asymmetric only) int32
      [N*b/32, G] packed along N, also offset; weight_shape [2] = (N, K); w = (q - zero_point) * scale.
  compressed-tensors float-quantized: weight float8_e4m3fn [N, K]; weight_scale [1] or [N, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from steploop.gpu_worker.model.quant.config import FP8, QuantScheme

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)    # AutoAWQ: column j of a word sits in nibble AWQ_REVERSE_ORDER[j]

# the tensor names each format stores per linear (suffixes of "<module>."), the required ones first
TENSORS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "ct_int": (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point",)),
    "ct_fp8": (("weight", "weight_scale"), ()),
}


@dataclass
class IntWeight:
    q: torch.Tensor              # uint8 [N, K]: unsigned codes 0..2^bits-1
    scale: torch.Tensor          # fp32 [N, G]
    zero: torch.Tensor           # fp32 [N, G] (integers): w = scale * (q - zero)
    g_idx: torch.Tensor | None   # int64 [K]: each input column's group; None: k // group_size
    group_size: int              # columns per group (K for per-channel)
    bits: int


@dataclass
class Fp8Weight:
    weight: torch.Tensor         # float8_e4m3fn [N, K]
    scale: torch.Tensor          # fp32 [N, 1] (per channel) or [1, 1] (per tensor)


def tensor_kind(scheme: QuantScheme) -> str:
    if scheme.method == "compressed-tensors":
        return "ct_fp8" if scheme.kind == FP8 else "ct_int"
    return scheme.method


class Shapes:
    """Expected stored shapes for one linear [N, K], checked from the safetensors headers before loading."""

    def __init__(self, scheme: QuantScheme, name: str, n: int, k: int):
        self.scheme, self.name, self.n, self.k = scheme, name, n, k
        self.per = 32 // scheme.bits
        gs = k if scheme.group_size == -1 else scheme.group_size
        if k % gs:
            raise ValueError(f"{name}: quantization group_size {scheme.group_size} does not divide the layer's "
                             f"{k} input features")
        self.groups = k // gs

    def expected(self) -> dict[str, tuple[int, ...]]:
        n, k, g, per, s = self.n, self.k, self.groups, self.per, self.scheme
        kind = tensor_kind(s)
        if kind == "gptq":
            return {"qweight": (_ceil(k, per), n), "qzeros": (g, _ceil(n, per)), "scales": (g, n), "g_idx": (k,)}
        if kind == "awq":
            return {"qweight": (k, _ceil(n, 8)), "qzeros": (g, _ceil(n, 8)), "scales": (g, n)}
        if kind == "ct_int":
            return {"weight_packed": (n, _ceil(k, per)), "weight_scale": (n, g), "weight_shape": (2,),
                    "weight_zero_point": (_ceil(n, per), g)}
        return {"weight": (n, k), "weight_scale": (n, 1) if s.per_channel_fp8 else (1,)}

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        required, optional = TENSORS[tensor_kind(self.scheme)]
        missing = [t for t in required if t not in shapes]
        if not self.scheme.symmetric and tensor_kind(self.scheme) == "ct_int" and "weight_zero_point" not in shapes:
            missing.append("weight_zero_point")
        if missing:
            raise ValueError(f"{self.name}: the checkpoint lacks {', '.join(missing)} for {self.scheme.describe()}")
        extra = [t for t in shapes if t not in required + optional]
        if extra:
            raise ValueError(f"{self.name}: unexpected tensors {extra} for {self.scheme.describe()}")
        want = self.expected()
        if self.scheme.kind == FP8 and shapes["weight_scale"] in ((1, 1), ()):
            want["weight_scale"] = shapes["weight_scale"]     # a per-tensor scale may be stored as [1, 1] or []
        for t, shape in shapes.items():
            if tuple(shape) != want[t]:
                raise ValueError(f"{self.name}.{t}: stored shape {tuple(shape)}, expected {want[t]} for a "
                                 f"[{self.n}, {self.k}] layer ({self.scheme.describe()})")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def unpack_along_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values per word along dim 0 -> uint8 [rows, C]."""
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed[:, None, :] >> shifts[None, :, None]) & mask          # [R, per, C]
    return vals.reshape(packed.shape[0] * per, packed.shape[1])[:rows].to(torch.uint8)


def unpack_along_cols(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values per word along dim 1 -> uint8 [R, cols]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)            # [R, C, per]
    return vals.reshape(packed.shape[0], -1)[:, :cols].to(torch.uint8)


def _gptq(t: dict[str, torch.Tensor], s: QuantScheme, n: int, k: int, gs: int) -> IntWeight:
    q = unpack_along_rows(t["qweight"], s.bits, k).T.contiguous()                   # [N, K]
    zero = unpack_along_cols(t["qzeros"], s.bits, n).T.float()                      # [N, G]
    if s.zeros_minus_one:
        zero = zero + 1      # AutoGPTQ v1: `zeros = zeros + 1` after masking (a stored 2^b - 1 reads as 2^b)
    g_idx = t.get("g_idx")
    return IntWeight(q, t["scales"].T.float().contiguous(), zero.contiguous(), _act_order(g_idx, k, gs), gs, s.bits)


def _awq(t: dict[str, torch.Tensor], s: QuantScheme, n: int, k: int, gs: int) -> IntWeight:
    def unpack(packed: torch.Tensor) -> torch.Tensor:     # [R, N/8] -> [R, N] in column order
        nibbles = unpack_along_cols(packed, 4, packed.shape[1] * 8).view(packed.shape[0], -1, 8)
        return nibbles[:, :, list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)[:, :n]
    q, zero = unpack(t["qweight"]).T.contiguous(), unpack(t["qzeros"]).T.float().contiguous()
    return IntWeight(q, t["scales"].T.float().contiguous(), zero, None, gs, 4)


def _ct_int(t: dict[str, torch.Tensor], s: QuantScheme, n: int, k: int, gs: int) -> IntWeight:
    if [int(v) for v in t["weight_shape"]] != [n, k]:
        raise ValueError(f"weight_shape {t['weight_shape'].tolist()} is not the layer's [{n}, {k}]")
    q = unpack_along_cols(t["weight_packed"], s.bits, k)                            # stored + 2^(b-1): unsigned
    zp = t.get("weight_zero_point")
    scale = t["weight_scale"].float().contiguous()
    # signed q - signed zp = (q + 2^(b-1)) - (zp + 2^(b-1)): the unsigned stored codes on both sides
    zero = (unpack_along_rows(zp, s.bits, n).float() if zp is not None
            else torch.full_like(scale, float(1 << (s.bits - 1))))
    return IntWeight(q, scale, zero.contiguous(), None, gs, s.bits)


_INT_READERS: dict[str, Callable[..., IntWeight]] = {"gptq": _gptq, "awq": _awq, "ct_int": _ct_int}


def _act_order(g_idx: torch.Tensor | None, k: int, gs: int) -> torch.Tensor | None:
    """None when g_idx is the plain k // group_size; else g_idx, checked to give every group group_size columns."""
    if g_idx is None:
        return None
    g_idx = g_idx.long()
    plain = torch.arange(k) // gs
    if torch.equal(g_idx, plain):
        return None
    if g_idx.min() < 0 or g_idx.max() >= k // gs or not torch.equal(torch.bincount(g_idx, minlength=k // gs),
                                                                         torch.full((k // gs,), gs)):
        raise ValueError(f"g_idx does not give each of the {k // gs} groups {gs} input columns")
    return g_idx


def read_linear(scheme: QuantScheme, name: str, tensors: dict[str, torch.Tensor], n: int,
                k: int) -> IntWeight | Fp8Weight:
    """One linear's stored tensors -> IntWeight / Fp8Weight (shapes were checked by Shapes.check)."""
    Shapes(scheme, name, n, k).check({t: tuple(v.shape) for t, v in tensors.items()})
    kind = tensor_kind(scheme)
    if kind == "ct_fp8":
        if tensors["weight"].dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}.weight: dtype {tensors['weight'].dtype}, expected float8_e4m3fn")
        return Fp8Weight(tensors["weight"], tensors["weight_scale"].float().reshape(-1, 1))
    gs = k if scheme.group_size == -1 else scheme.group_size
    try:
        return _INT_READERS[kind](tensors, scheme, n, k, gs)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


def dequantize(w: IntWeight | Fp8Weight) -> torch.Tensor:
    """The format's reference dequantization in fp32 -> [N, K] (the oracle, and the torch path of linear.py)."""
    if isinstance(w, Fp8Weight):
        return w.weight.float() * w.scale
    k = w.q.shape[1]
    g = w.g_idx if w.g_idx is not None else torch.arange(k) // w.group_size
    return w.scale[:, g] * (w.q.float() - w.zero[:, g])
