"""Small random Llama / Qwen2 models quantized in the test by a writer that follows each published format, and the
transformers fp32 oracle on each format's reference dequantization.

    path, oracle = build_quant_model("llama", Spec("gptq", bits=4, group_size=32, sym=False, desc_act=True), dir, tok)

Writers (RTN quantization; the format, not the quantizer's quality, is under test):
  GPTQ: AutoGPTQ's `QuantLinear.pack` (qweight packed along K, qzeros along N, v1 zero - 1, g_idx per column; act-order
        as a random column permutation with g_idx[perm[j]] = j // group_size)
  AWQ:  AutoAWQ's `WQLinear_GEMM.from_linear` (pack along N with order_map [0, 2, 4, 6, 1, 3, 5, 7])
  compressed-tensors: `pack_to_int32` (signed + 2^(b-1), along K; zero points along N) and float-quantized FP8.
Reference dequantization (the oracle's weights), written independently of steploop's reader:
  GPTQ: gptqmodel/AutoGPTQ torch `dequantize_weight`: zeros = unpack(qzeros) & mask (+ 1 for v1); weight =
        scales[g_idx] * (unpack(qweight) - zeros[g_idx])
  AWQ:  AutoAWQ `unpack_awq` + `reverse_awq_order` + `dequantize_gemm`: (iweight - izeros) * scales
  compressed-tensors: its own PackedQuantizationCompressor / FloatQuantizationCompressor.decompress
FP8 W8A8's oracle also fake-quantizes each quantized linear's input with compressed-tensors' own dynamic token
quantization (forward_quantize), as its reference forward does.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from tests.worker.family_models import _COMMON, FAMILY_CONFIGS, TOKENIZER_FILES

QUANT_FAMILIES = {
    # plain Llama (the C whole-step decoder's layer), GQA 4/2, MLP 256 so down_proj has K = 256
    "llama": ("LlamaConfig", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                              "tie_word_embeddings": False}),
    "qwen2": FAMILY_CONFIGS["qwen2"],     # q/k/v biases, tied embeddings
    # mixtures of experts: every expert's projections quantized (and Qwen2-MoE's shared expert, and the dense layers'
    # MLPs), the routers not, as GPTQModel, AutoAWQ and llm-compressor write them
    "qwen3_moe": FAMILY_CONFIGS["qwen3_moe"],
    "qwen2_moe": FAMILY_CONFIGS["qwen2_moe"],
    "mixtral": FAMILY_CONFIGS["mixtral"],
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
EXPERT_LINEAR = re.compile(r"\.(experts\.\d+|shared_expert)\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")


def quantized(name: str) -> bool:
    """Whether the writer quantizes the linear module `name`."""
    return name.endswith(LINEARS) or EXPERT_LINEAR.search(name) is not None


@dataclass(frozen=True)
class Spec:
    method: str                 # gptq | awq | ct_int | ct_fp8
    bits: int = 4
    group_size: int = 128       # -1: per channel
    sym: bool = True
    desc_act: bool = False
    v1: bool = True             # GPTQ checkpoint_format "gptq" (zero - 1 stored)
    fp8_channel: bool = False

    @property
    def id(self) -> str:
        if self.method == "ct_fp8":
            return f"ct_fp8_{'channel' if self.fp8_channel else 'tensor'}"
        return (f"{self.method}{self.bits}_g{self.group_size}_{'sym' if self.sym else 'asym'}"
                + ("_actorder" if self.desc_act else "") + ("" if self.v1 else "_v2"))


# ---- packing (writers) ----

def _to_int32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R*bits/32, C], value j of word i = codes[i*per + j] at bits*j (AutoGPTQ qweight)."""
    per = 32 // bits
    c = codes.long().view(-1, per, codes.shape[1])
    return _to_int32(sum(c[:, j] << (bits * j) for j in range(per)))


def pack_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] -> int32 [R, C*bits/32]; nibble i of word w holds column w*per + order[i] (AWQ's order_map)."""
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.long().view(codes.shape[0], -1, per)
    return _to_int32(sum(c[:, :, order[i]] << (bits * i) for i in range(per)))


# ---- RTN quantization ----

def _groups(k: int, spec: Spec, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    gs = k if spec.group_size == -1 else spec.group_size
    if not spec.desc_act:
        return torch.arange(k) // gs, gs
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // gs
    return g_idx, gs


def quantize_int(w: torch.Tensor, spec: Spec, g_idx: torch.Tensor, gs: int, scale_dtype: torch.dtype):
    """w [N, K] -> (codes uint [N, K], scale [N, G] in scale_dtype, zero [N, G] long): w ~ scale * (codes - zero)."""
    n, k = w.shape
    maxq = 2 ** spec.bits - 1
    order = torch.argsort(g_idx, stable=True)
    grouped = w[:, order].view(n, k // gs, gs)
    if spec.sym:
        scale = (grouped.abs().amax(-1) * 2 / maxq).clamp(min=1e-6)
        zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.long)
    else:
        lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-6)
        zero = torch.round(-lo / scale).long().clamp(1 if spec.v1 and spec.method == "gptq" else 0, maxq)
    scale = scale.to(scale_dtype)
    g = g_idx
    codes = torch.round(w / scale.float()[:, g]) + zero[:, g]
    return codes.clamp(0, maxq).long(), scale, zero


# ---- per-format writers: (stored tensors of one linear) ----

def write_gptq(w: torch.Tensor, spec: Spec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    g_idx, gs = _groups(w.shape[1], spec, gen)
    codes, scale, zero = quantize_int(w, spec, g_idx, gs, torch.float16)
    stored_zero = zero - 1 if spec.v1 else zero
    return {"qweight": pack_rows(codes.T.contiguous(), spec.bits),
            "qzeros": pack_cols((stored_zero & (2 ** spec.bits - 1)).T.contiguous(), spec.bits),
            "scales": scale.T.contiguous(), "g_idx": g_idx.to(torch.int32)}


def write_awq(w: torch.Tensor, spec: Spec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    g_idx, gs = _groups(w.shape[1], spec, gen)
    codes, scale, zero = quantize_int(w, spec, g_idx, gs, torch.float16)
    order_map = (0, 2, 4, 6, 1, 3, 5, 7)
    return {"qweight": pack_cols(codes.T.contiguous(), 4, order_map),
            "qzeros": pack_cols(zero.T.contiguous(), 4, order_map), "scales": scale.T.contiguous()}


def write_ct_int(w: torch.Tensor, spec: Spec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    g_idx, gs = _groups(w.shape[1], spec, gen)
    codes, scale, zero = quantize_int(w, spec, g_idx, gs, torch.float32)
    offset = 2 ** (spec.bits - 1)
    if spec.sym:       # compressed-tensors' symmetric codes are signed around 0: the stored form is code + offset
        zero = torch.full_like(zero, offset)
    out = {"weight_packed": pack_cols(codes, spec.bits), "weight_scale": scale,
           "weight_shape": torch.tensor(list(w.shape))}
    if not spec.sym:   # stored zero point = signed zero point + offset = our unsigned zero
        out["weight_zero_point"] = pack_rows(zero, spec.bits)
    return out


def write_ct_fp8(w: torch.Tensor, spec: Spec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    amax = w.abs().amax(-1, keepdim=True) if spec.fp8_channel else w.abs().amax().reshape(1)
    scale = (amax / 448).clamp(min=1e-12).float()
    q = (w / (scale if spec.fp8_channel else scale[0])).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}


WRITERS = {"gptq": write_gptq, "awq": write_awq, "ct_int": write_ct_int, "ct_fp8": write_ct_fp8}


# ---- reference dequantization (each format's own code, restated) ----

def _ct_scheme(spec: Spec):
    from compressed_tensors.quantization import QuantizationScheme
    return QuantizationScheme.model_validate(_ct_group(spec))


def reference_dequantize(t: dict[str, torch.Tensor], spec: Spec, n: int, k: int) -> torch.Tensor:
    if spec.method == "gptq":     # AutoGPTQ / gptqmodel torch QuantLinear.dequantize_weight
        bits, mask = spec.bits, 2 ** spec.bits - 1
        wf = torch.arange(0, 32, bits, dtype=torch.int32)
        zeros = torch.bitwise_right_shift(t["qzeros"].unsqueeze(2).expand(-1, -1, 32 // bits), wf.view(1, 1, -1))
        zeros = torch.bitwise_and(zeros, mask).reshape(t["scales"].shape).long()
        if spec.v1:
            zeros = zeros + 1
        weight = torch.bitwise_right_shift(t["qweight"].unsqueeze(1).expand(-1, 32 // bits, -1), wf.view(1, -1, 1))
        weight = torch.bitwise_and(weight, mask).reshape(-1, t["qweight"].shape[1]).long()     # [K, N]
        g = t["g_idx"].long()
        return (t["scales"].float()[g] * (weight - zeros[g]).float()).T.contiguous()
    if spec.method == "awq":      # AutoAWQ unpack_awq, reverse_awq_order, dequantize_gemm
        shifts = torch.arange(0, 32, 4)
        def unpack(x):
            iw = torch.bitwise_right_shift(x[:, :, None], shifts[None, None, :]).to(torch.int8).view(x.shape[0], -1)
            reverse = torch.arange(iw.shape[-1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
            return torch.bitwise_and(iw[:, reverse], 15)
        iweight, izeros = unpack(t["qweight"]), unpack(t["qzeros"])
        gs = k if spec.group_size == -1 else spec.group_size
        izeros = izeros.repeat_interleave(gs, dim=0)
        scales = t["scales"].float().repeat_interleave(gs, dim=0)
        return ((iweight.float() - izeros.float()) * scales).T.contiguous()
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    compressor = PackedQuantizationCompressor if spec.method == "ct_int" else FloatQuantizationCompressor
    return compressor.decompress(dict(t), _ct_scheme(spec))["weight"].float()


# ---- config.json quantization_config ----

def _ct_group(spec: Spec) -> dict:
    if spec.method == "ct_fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "channel" if spec.fp8_channel else "tensor", "observer": "minmax"}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token",
                "observer": None}
        return {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
                "format": "float-quantized"}
    weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym, "dynamic": False,
               "strategy": "channel" if spec.group_size == -1 else "group",
               "group_size": None if spec.group_size == -1 else spec.group_size, "actorder": None,
               "observer": "minmax"}
    return {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
            "format": "pack-quantized"}


def quantization_config(spec: Spec) -> dict:
    if spec.method == "gptq":
        return {"quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size, "desc_act": spec.desc_act,
                "sym": spec.sym, "damp_percent": 0.01, "true_sequential": True,
                "checkpoint_format": "gptq" if spec.v1 else "gptq_v2"}
    if spec.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": spec.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    fmt = "float-quantized" if spec.method == "ct_fp8" else "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": _ct_group(spec)}, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "sparsity_config": {}, "global_compression_ratio": None, "version": "0.20.1"}


# ---- the model folder and its oracle ----

def make_family_config(family: str):
    import transformers
    name, kwargs = QUANT_FAMILIES[family]
    return getattr(transformers, name)(**{**_COMMON, **kwargs})


def build_quant_model(family: str, spec: Spec, out: pathlib.Path, tokenizer_dir: pathlib.Path, seed: int = 0):
    """Write the quantized folder; returns (path, oracle transformers model on the reference-dequantized weights)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    config = make_family_config(family)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, module in model.named_modules():
            if not quantized(name):
                continue
            stored = WRITERS[spec.method](module.weight.detach(), spec, gen)
            tensors.update({f"{name}.{t}": v.contiguous() for t, v in stored.items()})
            module.weight.copy_(reference_dequantize(stored, spec, *module.weight.shape))
    state = model.state_dict()
    for name, value in state.items():
        module = name.rsplit(".", 1)[0]
        if quantized(module) and name.endswith(".weight"):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensors[name] = value.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["quantization_config"] = quantization_config(spec)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    model.eval()
    if spec.method == "ct_fp8":
        _fake_quantize_inputs(model)
    return out, model


def _fake_quantize_inputs(model) -> None:
    """compressed-tensors' reference forward for dynamic token activations: each quantized linear's input goes
    through its forward_quantize (scale from compute_dynamic_scales_and_zp, then fake_quantize)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")

    def hook(module, inputs):
        x = inputs[0]
        scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
        return (fake_quantize(x=x, scale=scale, zero_point=zero_point, args=args),)

    for name, module in model.named_modules():
        if quantized(name):
            module.register_forward_pre_hook(hook)
