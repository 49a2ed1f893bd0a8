"""QuantScheme: what a checkpoint's `quantization_config` says, read once at start; anything steploop cannot compute
exactly is refused here (ValueError naming the method or field: the worker exits 2 before any weight is read).

Accepted (each as its own published format writes it, see formats.py):
    gptq                 bits 4/8, group_size > 0 or -1 (per channel), desc_act (g_idx), sym or asym,
                         checkpoint_format "gptq" (v1: stored zeros are zero - 1) or "gptq_v2"
    awq                  bits 4, version "gemm", zero_point true, group_size > 0 or -1
    compressed-tensors   format pack-quantized (int 4/8 weights, group/channel, sym or asym; W4A16, W8A16)
                         format float-quantized (FP8 e4m3 weights per tensor/channel, activations dynamic per token)
                         with or without an FP8 kv_cache_scheme (static per-tensor: the k/v scales it stores are read
                         by model/kv_scales.py and used under --kv-cache-dtype fp8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INT, FP8 = "int", "fp8"
_REFUSED = {"bitsandbytes": "bitsandbytes", "hqq": "hqq", "mxfp4": "MXFP4", "fp8": "fp8 (transformers' own)",
            "eetq": "eetq", "quanto": "quanto", "aqlm": "aqlm", "exl2": "exl2", "torchao": "torchao",
            "fbgemm_fp8": "fbgemm_fp8", "higgs": "higgs", "vptq": "vptq", "spqr": "spqr", "bitnet": "bitnet"}


@dataclass(frozen=True)
class QuantScheme:
    method: str                 # "gptq" | "awq" | "compressed-tensors"
    kind: str                   # INT (integer weights, fp activations) | FP8 (e4m3 weights and activations)
    bits: int                   # 4 or 8
    group_size: int             # INT: input channels per scale; -1: one group per output row (per channel)
    symmetric: bool             # INT: whether the zero point is implied (2^(bits-1) for GPTQ, 0 for c-t)
    desc_act: bool = False      # GPTQ: g_idx orders the groups (act-order); c-t: actorder "group"
    zeros_minus_one: bool = False   # GPTQ v1 checkpoints store zero - 1 (AutoGPTQ's packing)
    per_channel_fp8: bool = False   # FP8: weight_scale [N, 1] (else one scale [1])

    def describe(self) -> str:
        if self.kind == FP8:
            return f"{self.method} FP8 W8A8 ({'per-channel' if self.per_channel_fp8 else 'per-tensor'} weights)"
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return (f"{self.method} int{self.bits} {group} {'sym' if self.symmetric else 'asym'}"
                + (" act-order" if self.desc_act else ""))


def read_quant_config(quant: dict[str, Any]) -> QuantScheme:
    """config.json's quantization_config -> QuantScheme; ValueError names what is not supported."""
    method = str(quant.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    name = _REFUSED.get(method, repr(method))
    raise ValueError(f"quantization_config quant_method {name} is not supported; steploop loads gptq, awq and "
                     "compressed-tensors safetensors checkpoints and GGUF files (--model FILE.gguf)")


def _refuse(method: str, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"quantization_config ({method}) {field}={value!r} is not supported (steploop runs {allowed})")


def _group_size(method: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value > 0):
        raise _refuse(method, "group_size", value, "a positive group size or -1 (per channel)")
    return value


def _gptq(q: dict[str, Any]) -> QuantScheme:
    bits = q.get("bits")
    if bits not in (4, 8):
        raise _refuse("gptq", "bits", bits, "4 and 8 bits")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", "checkpoint_format", fmt, "gptq and gptq_v2")
    if q.get("lm_head"):
        raise _refuse("gptq", "lm_head", True, "an unquantized lm_head")
    if q.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise _refuse("gptq", "pack_dtype", q.get("pack_dtype"), "int32 packing")
    return QuantScheme("gptq", INT, bits, _group_size("gptq", q.get("group_size", 128)),
                       bool(q.get("sym", True)), bool(q.get("desc_act", False)), zeros_minus_one=fmt == "gptq")


def _awq(q: dict[str, Any]) -> QuantScheme:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise _refuse("awq", "bits", bits, "4 bits")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", "version", version, "the GEMM packing")
    if not q.get("zero_point", True):
        raise _refuse("awq", "zero_point", False, "zero_point true")
    return QuantScheme("awq", INT, 4, _group_size("awq", q.get("group_size", q.get("q_group_size", 128))), False)


def _compressed_tensors(q: dict[str, Any]) -> QuantScheme:
    m = "compressed-tensors"
    for field in ("sparsity_config", "transform_config"):
        if q.get(field):
            raise _refuse(m, field, q[field], "no sparsity or transform scheme")
    kv = q.get("kv_cache_scheme")
    if kv and ((kv.get("type"), kv.get("num_bits"), kv.get("strategy"), bool(kv.get("dynamic"))) !=
               ("float", 8, "tensor", False) or not kv.get("symmetric", True)):
        raise _refuse(m, "kv_cache_scheme", kv, "an FP8 KV cache scheme with static per-tensor scales")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(m, "config_groups", sorted(groups), "exactly one config group")
    group = next(iter(groups.values()))
    if group.get("targets") != ["Linear"]:
        raise _refuse(m, "targets", group.get("targets"), 'targets ["Linear"]')
    if group.get("output_activations"):
        raise _refuse(m, "output_activations", group["output_activations"], "no output quantization")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(m, "quantization_status", status, "compressed checkpoints")
    fmt = group.get("format") or q.get("format")
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    if fmt == "pack-quantized":
        return _ct_int(weights, acts)
    if fmt == "float-quantized":
        return _ct_fp8(weights, acts)
    raise _refuse(m, "format", fmt, "pack-quantized (W4A16, W8A16) and float-quantized (FP8 W8A8)")


def _ct_int(w: dict[str, Any], acts: Any) -> QuantScheme:
    m = "compressed-tensors pack-quantized"
    if acts:
        raise _refuse(m, "input_activations", acts, "weight-only int (W4A16, W8A16)")
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
        raise _refuse(m, "weights", f"{w.get('type')}{w.get('num_bits')}", "int4 and int8 weights")
    if w.get("dynamic"):
        raise _refuse(m, "weights.dynamic", w["dynamic"], "static weight scales")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(m, "weights.strategy", strategy, "group and channel")
    if w.get("actorder") not in (None, "weight", "static"):    # "weight": only the order of quantizing, not stored
        raise _refuse(m, "weights.actorder", w["actorder"], "no stored activation order")
    if w.get("block_structure"):
        raise _refuse(m, "weights.block_structure", w["block_structure"], "group and channel")
    group = _group_size(m, w.get("group_size")) if strategy == "group" else -1
    return QuantScheme("compressed-tensors", INT, w["num_bits"], group, bool(w.get("symmetric", True)))


def _ct_fp8(w: dict[str, Any], acts: Any) -> QuantScheme:
    m = "compressed-tensors float-quantized"
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(m, "weights", f"{w.get('type')}{w.get('num_bits')}", "FP8 (float8 e4m3) weights")
    if w.get("strategy") not in ("tensor", "channel") or w.get("dynamic") or not w.get("symmetric", True):
        raise _refuse(m, "weights.strategy", w.get("strategy"), "static symmetric per-tensor or per-channel scales")
    acts = acts or {}
    if (acts.get("type"), acts.get("num_bits"), acts.get("strategy"), acts.get("dynamic")) != \
            ("float", 8, "token", True) or not acts.get("symmetric", True):
        raise _refuse(m, "input_activations", acts or None, "FP8 activations quantized dynamically per token")
    return QuantScheme("compressed-tensors", FP8, 8, -1, True, per_channel_fp8=w["strategy"] == "channel")
