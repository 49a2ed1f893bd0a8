"""Load a HuggingFace folder of a supported family (config.json + *.safetensors, sharded or not) into
LlamaForCausalLM.

Checkpoint names map onto ours one to one, except q/k/v_proj (fused into qkv_proj) and gate/up_proj (fused into
gate_up_proj), which are copied into row slices (Phi-3 checkpoints hold them fused already). Every parameter must be
filled once, or loading fails. Gemma's (1 + w) norms get the 1 folded into the loaded weights.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re

import torch
from safetensors import safe_open

from steploop.common import envs
from steploop.gpu_worker.attention.backend import AttentionBackend
from steploop.gpu_worker.distributed.comm import TensorParallelComm
from steploop.gpu_worker.distributed.parallel_layers import make_tensor_parallel
from steploop.gpu_worker.distributed.pipeline import PipelineComm, StageShare, stage_config
from steploop.gpu_worker.distributed.shapes import RankShare, local_config
from steploop.gpu_worker.distributed.sharding import CheckpointSharder
from steploop.gpu_worker.gguf.weights import gguf_source, load_gguf_weights
from steploop.gpu_worker.kernel_plan import KernelPlan
from steploop.gpu_worker.model.half_weights import HalfWeights
from steploop.gpu_worker.model.kv_scales import KvScales
from steploop.gpu_worker.model.layers import RMSNorm
from steploop.gpu_worker.model.llama import LlamaForCausalLM
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from steploop.gpu_worker.model.moe import NOT_HELD, expert_target
from steploop.gpu_worker.model.packed_linear_layer import pack_linear_weights
from steploop.gpu_worker.model.quant.loading import QuantLoader
from steploop.gpu_worker.packed_weight_cache import PackedWeightCache

log = logging.getLogger(__name__)

_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# Gemma 3 with images: its checkpoint's text decoder sits under language_model (transformers 4's saved layout,
# model.language_model in 5's), the tower and projector under model. in 5; ours are the text model's names
_GEMMA3_NAMES = re.compile(r"^(?:model\.)?(language_model\.model\.|language_model\.lm_head\.|language_model\.|"
                           r"vision_tower\.|multi_modal_projector\.)")


def _gemma3_name(m: re.Match) -> str:
    return {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
            "language_model.": "model."}.get(m.group(1), m.group(1))


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights (steploop reads safetensors only)")
    return files


def load_model(path: pathlib.Path, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
               device: torch.device, plan: KernelPlan | None = None, tp_share: RankShare | None = None,
               tp_comm: TensorParallelComm | None = None, stage: StageShare | None = None,
               pipe: PipelineComm | None = None) -> LlamaForCausalLM:
    """plan None: KernelPlan.reference (no C kernel). With plan.packed_linears the loaded weights are packed
    (or read from the packed-weight cache) before this returns. With tp_share the model is this rank's share
    (its heads, MLP rows and vocabulary rows), wired to all-reduce / all-gather through tp_comm. With stage, only
    that pipeline stage's layers (and embedding / head, distributed/pipeline.py) are built and read; its hidden
    states come and go through pipe."""
    full_cfg = LlamaModelConfig.from_dir(path)
    if full_cfg.is_multimodal and (tp_share is not None or stage is not None or full_cfg.quant is not None
                                   or gguf_source(path)):
        raise ValueError(f"{full_cfg.model_type}: vision-language models run unquantized on one rank only "
                         "(no --tensor-parallel-size > 1, --pipeline-parallel-size > 1, quantized or GGUF "
                         "checkpoint yet)")
    if stage is not None and gguf_source(path) is not None:
        raise ValueError(f"-pp {stage.num_stages} with a GGUF file: pipeline stages read safetensors folders only")
    base = full_cfg if stage is None else stage_config(full_cfg, stage)
    cfg = base if tp_share is None else local_config(base, tp_share)
    quant = half = None
    with torch.device("meta"):
        model = _model_class(cfg)(cfg, backend, max_positions, plan)
        if stage is not None:       # never allocated: what other stages hold
            _drop_unheld(model, stage)
        sharder = None if tp_share is None else CheckpointSharder(full_cfg, tp_share)
        if cfg.quant is not None:     # before to_empty: the quantized linears never get an fp32 weight
            quant = QuantLoader.prepare(model, cfg, safetensors_files(path), device, _use_c(plan, device, dtype),
                                        _target, sharder)
        elif gguf_source(path) is None and _use_c(plan, device, dtype) and model.plan.packed_linears:
            # a bf16 / fp16 checkpoint's linears stay 16-bit on the CPU, widened exactly in the C kernels
            half = HalfWeights.prepare(model, cfg, safetensors_files(path), lambda n: _our_name(n, cfg, stage),
                                       _target)
    # cast while still on meta, so the device holds only the target dtype (building fp32 first and casting made an
    # 8B model peak at 32 GB); each checkpoint tensor is then read in its stored dtype and cast by copy_ on the device
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.kv_scales = KvScales()    # FP8 KV cache scales the checkpoint carries (used by --kv-cache-dtype fp8)
    gguf = gguf_source(path)
    if gguf is not None:            # weights read from the GGUF file itself (gguf/weights.py)
        params = dict(model.named_parameters())
        filled, gguf_summary = load_gguf_weights(model, cfg, path, gguf, model.plan.packed_linears, _target, sharder)
        _check_complete(params, filled, cfg)
        log.info("%s", gguf_summary)
    else:
        _load_weights(model, cfg, path, sharder, quant, stage, half)
        if quant is not None:
            log.info("%s", quant.check_done())
        if half is not None:
            log.info("%s", half.check_done())
    if tp_share is not None:
        make_tensor_parallel(model, tp_share, tp_comm, full_cfg.vocab_size)
        model.config = base          # the runner samples over the whole vocabulary
    model.pipe = pipe
    if cfg.norm_offset:
        _fold_norm_offset(model, cfg.norm_offset)
    for rotary in model.rotaries():
        rotary.build_cache(device, dtype)
    if hasattr(model, "finish_load"):
        model.finish_load(device)
    if model.plan.packed_linears and gguf is None:
        # a rank's or stage's share is not the checkpoint's whole model the cache keys on
        cache = PackedWeightCache.for_checkpoint(safetensors_files(path)) if tp_share is None and stage is None \
            else None
        log.info("%s", pack_linear_weights(model, cache))
    return model.eval()


def _model_class(cfg: LlamaModelConfig) -> type[LlamaForCausalLM]:
    if cfg.model_type == "qwen2_5_vl":
        from steploop.gpu_worker.model.qwen2_5_vl import Qwen2_5_VLForCausalLM
        return Qwen2_5_VLForCausalLM
    if cfg.model_type == "gemma3":
        from steploop.gpu_worker.model.gemma3_vlm import Gemma3VLForCausalLM
        return Gemma3VLForCausalLM
    return LlamaForCausalLM


def _use_c(plan: KernelPlan | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether quantized linears run packed_linear.c: fp32 on the CPU with the C kernels allowed and built (plan None
    is the reference: torch only). Not the plan's packed_linears, whose probe weighs fp32 against packed weights:
    a quantized weight has no fp32 copy, and dequantizing it per call is the slow path."""
    if plan is None or device.type != "cpu" or dtype != torch.float32 or \
            envs.switched_off(envs.CPU_KERNELS, envs.CPU_PACKED_WEIGHTS):
        return False
    from steploop.gpu_worker.cpu_kernels import packed_linear
    return packed_linear.available()


def _fold_norm_offset(model: LlamaForCausalLM, offset: float) -> None:
    """Gemma's norms scale by (offset + w): store offset + w so every rms_norm implementation applies it."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(offset)


def _drop_unheld(model: LlamaForCausalLM, stage: StageShare) -> None:
    if not stage.holds_embedding:
        model.model.embed_tokens = None
    if not stage.is_last:
        model.model.norm, model.lm_head = None, None


def _our_name(stored: str, cfg: LlamaModelConfig, stage: StageShare | None) -> str | None:
    """A checkpoint tensor's name in our model (None: another pipeline stage's)."""
    name = _GEMMA3_NAMES.sub(_gemma3_name, stored) if cfg.model_type == "gemma3" else stored
    return name if stage is None else stage.local_name(name)


def _load_weights(model: LlamaForCausalLM, cfg: LlamaModelConfig, path: pathlib.Path,
                  sharder: CheckpointSharder | None = None, quant: QuantLoader | None = None,
                  stage: StageShare | None = None, half: HalfWeights | None = None) -> None:
    params = dict(model.named_parameters())
    filled: set[str] = set()
    files = safetensors_files(path)
    for i, file in enumerate(files, 1):
        log.info("loading weights %d/%d: %s", i, len(files), file.name)
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():
                name = _our_name(stored, cfg, stage)
                if name is None:             # another pipeline stage's
                    continue
                if _IGNORED.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if model.kv_scales.take(name, lambda: f.get_tensor(stored)):
                    continue
                if quant is not None and quant.take(name):
                    quant.put(name, f.get_tensor(stored))
                    continue
                target, expert, rows = _target(name, cfg)
                if (target, expert, rows) == NOT_HELD:      # expert parallel: another rank's expert
                    continue
                tensor = f.get_tensor(stored) if sharder is None else sharder.shard(name, f.get_tensor(stored))
                if half is not None and half.take(target):     # kept at 16 bits (half_weights.py)
                    half.put(target, rows, tensor)
                    continue
                if target not in params:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} (not a weight of this model_type)")
                dest = params[target].data if expert is None else params[target].data[expert]
                dest = dest if rows is None else dest[rows[0]:rows[1]]
                if dest.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
                dest.copy_(tensor)
                part = ("" if expert is None else f"[{expert}]") + ("" if rows is None else f"[{rows[0]}:{rows[1]}]")
                filled.add(target + part)
    _check_complete(params, filled, cfg)


def _target(name: str, cfg: LlamaModelConfig) -> tuple[str, int | None, tuple[int, int] | None]:
    """Checkpoint name -> (our parameter name, expert index or None, row slice or None)."""
    if cfg.moe is not None:
        routed = expert_target(name, cfg.moe)
        if routed is not None:
            return routed
    m = _FUSED.match(name)
    if not m:
        return name, None, None
    prefix, _, qkv, gate_up, kind = m.groups()
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    if qkv:
        start = {"q": 0, "k": q, "v": q + kv}[qkv]
        return f"{prefix}self_attn.qkv_proj.{kind}", None, (start, start + (q if qkv == "q" else kv))
    start = 0 if gate_up == "gate" else inter
    return f"{prefix}mlp.gate_up_proj.{kind}", None, (start, start + inter)


def _check_complete(params: dict, filled: set[str], cfg: LlamaModelConfig) -> None:
    """Every parameter filled whole, or by all of its parts (q/k/v, gate/up, each expert's pieces)."""
    experts = cfg.moe.held_experts if cfg.moe is not None else 0
    parts = {"qkv_proj": 3, "gate_up_proj": 2, "mlp.w13": 2 * experts, "mlp.w2": experts, "shared_w13": 2}
    covered = {n.split("[")[0] for n in filled}
    missing = [n for n in params if n not in covered]
    partial = [n for n in covered if n not in filled
               and sum(f.startswith(n + "[") for f in filled) != next(v for k, v in parts.items() if k in n)]
    if cfg.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
    if missing or partial:
        raise ValueError(f"checkpoint is missing weights: {(missing + partial)[:8]}")
