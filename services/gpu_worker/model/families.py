"""Supported model families as declared differences from the Llama decoder, and the config-field audit.

parse_config(path) reads config.json through transformers' own config class (version 4 or 5: config_compat.py) (so derived fields, e.g. Qwen2's
layer_types from use_sliding_window / max_window_layers, are what transformers computes), then the family's reader
below. Every field of config.to_dict() must be either read by the reader or listed in INERT_FIELDS (documented as
not changing the output); any other field that is set (not None / false / 0 / empty) is refused with a ValueError
naming it and its value, which the worker turns into exit code 2 before any weight is loaded.
tests/worker/test_families_config.py walks each family's config class and fails on a field in neither set.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

from steploop.gpu_worker.model.config_compat import to_v4_rope
from steploop.gpu_worker.model.moe import MoESpec
from steploop.gpu_worker.model.rotary import ROPE_TYPES, rope_type

# Fields that do not change the forward's output, with the reason.
INERT_FIELDS: dict[str, str] = {
    **dict.fromkeys(("attention_dropout", "embd_pdrop", "resid_pdrop"), "dropout: off at inference"),
    **dict.fromkeys(("initializer_range", "use_cache", "router_aux_loss_coef", "output_router_logits"),
                    "training / caching switches"),
    "pretraining_tp": "transformers >= 4.45 ignores it (the split matmul was the same product)",
    **dict.fromkeys(("_sliding_window_pattern", "sliding_window_pattern@gemma3_text"),
                    "Gemma 3: already expanded into layer_types, which is read"),
    "hidden_activation@gemma": "transformers' GemmaMLP uses hidden_act (the oracle); hidden_activation is unused",
    **dict.fromkeys(("hidden_act@gemma2", "hidden_act@gemma3_text"),
                    "Gemma 2/3's MLP uses hidden_activation, which is read"),
    **dict.fromkeys(("cache_implementation", "_attn_implementation_autoset"), "how transformers caches / attends"),
    "auto_map": "custom-code pointers: transformers' built-in class (the oracle) does not use them",
    "chunk_size_feed_forward": "chunking the MLP over tokens computes the same values",
    **dict.fromkeys(("matryoshka_dimensions", "is_matryoshka"),
                    "embeddings: which `dimensions` a pooling worker allows (gpu_worker/pooling.py reads them)"),
    "dtype": "the worker's --dtype decides (auto: fp32 on CPU, bf16 on CUDA)",
    "torch_dtype": "the worker's --dtype decides",
    **dict.fromkeys((
        "_name_or_path", "_model_name_or_path", "unk_token_id", "architectures", "transformers_version", "model_type", "id2label", "label2id",
        "finetuning_task", "problem_type", "tokenizer_class", "prefix", "task_specific_params", "bos_token_id",
        "pad_token_id", "sep_token_id", "decoder_start_token_id", "eos_token_id", "output_attentions",
        "output_hidden_states", "output_scores", "return_dict", "return_dict_in_generate", "torchscript",
        "use_bfloat16", "tf_legacy_loss", "is_decoder"), "metadata / output plumbing; EOS comes from eos_token_ids"),
    **dict.fromkeys((
        "bad_words_ids", "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
        "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "forced_bos_token_id",
        "forced_eos_token_id", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
        "num_beam_groups", "num_beams", "num_return_sequences", "remove_invalid_values", "repetition_penalty",
        "suppress_tokens", "temperature", "top_k", "top_p", "typical_p"),
        "legacy generation defaults: sampling is per request (generation_config.json gives the defaults)"),
}

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


class Fields:
    """A config's to_dict() that records which keys the reader looked at."""

    def __init__(self, values: dict[str, Any], model_type: str):
        self.values, self.model_type, self.read = values, model_type, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.values.get(key)
        return default if value is None else value

    def refuse_if(self, key: str, bad: Callable[[Any], bool], why: str) -> None:
        value = self.get(key)
        if value is not None and bad(value):
            raise ValueError(f"config.json {key}={value!r} is not supported for model_type {self.model_type!r}: "
                             f"{why}")

    def unaccounted(self) -> list[str]:
        """Fields neither read nor documented as inert."""
        return sorted(k for k in self.values if k not in self.read and k not in INERT_FIELDS
                      and f"{k}@{self.model_type}" not in INERT_FIELDS)


def _decoder(f: Fields, act_key: str = "hidden_act") -> dict[str, Any]:
    """The Llama decoder's fields, read the same way for every family."""
    heads = f.get("num_attention_heads")
    hidden = f.get("hidden_size")
    act = f.get(act_key, "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json {act_key}={act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    scaling = f.get("rope_scaling")
    if rope_type(scaling) not in ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling={scaling!r}: rope type {rope_type(scaling)!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    for key in ("pruned_heads", "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
                "tie_encoder_decoder"):
        f.refuse_if(key, bool, "steploop runs decoder-only models with every head")
    bias = bool(f.get("attention_bias", False))
    return {
        "vocab_size": f.get("vocab_size"), "hidden_size": hidden, "intermediate_size": f.get("intermediate_size"),
        "num_hidden_layers": f.get("num_hidden_layers"), "num_attention_heads": heads,
        "num_key_value_heads": f.get("num_key_value_heads", heads), "head_dim": f.get("head_dim", hidden // heads),
        "rms_norm_eps": f.get("rms_norm_eps", 1e-6), "rope_theta": f.get("rope_theta", 10000.0),
        "max_position_embeddings": f.get("max_position_embeddings", 2048),
        "tie_word_embeddings": bool(f.get("tie_word_embeddings", False)), "attention_bias": bias,
        "mlp_bias": bool(f.get("mlp_bias", False)), "rope_scaling": scaling, "hidden_act": ACTIVATIONS[act],
        "model_type": f.model_type}


def _windows(f: Fields, num_layers: int, per_layer: bool) -> tuple[int | None, ...]:
    """Per layer window: every layer (Mistral, Phi-3) or the layers layer_types marks sliding_attention."""
    window = f.get("sliding_window")
    types = f.get("layer_types") if per_layer else None
    if types is None:
        return (window,) * num_layers if window else ()
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config.json layer_types has {unknown}: only full_attention and sliding_attention run")
    if window is None and "sliding_attention" in types:
        raise ValueError("config.json layer_types names sliding_attention layers but sliding_window is null")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _llama(f: Fields) -> dict[str, Any]:
    cfg = _decoder(f)
    f.refuse_if("sliding_window", bool, "Llama attends to the whole context")
    return cfg


def _mistral(f: Fields) -> dict[str, Any]:
    cfg = _decoder(f)
    return {**cfg, "layer_windows": _windows(f, cfg["num_hidden_layers"], per_layer=f.model_type == "ministral")}


def _qwen2(f: Fields) -> dict[str, Any]:
    cfg = _mistral_like(f)
    return {**cfg, "attention_bias": True, "o_bias": False}


def _mistral_like(f: Fields) -> dict[str, Any]:
    cfg = _decoder(f)
    f.get("use_sliding_window"), f.get("max_window_layers")   # already folded into layer_types by transformers
    return {**cfg, "layer_windows": _windows(f, cfg["num_hidden_layers"], per_layer=True)}


def _qwen3(f: Fields) -> dict[str, Any]:
    return {**_mistral_like(f), "qk_norm": "head"}


def _gemma(f: Fields, act_key: str = "hidden_act") -> dict[str, Any]:
    cfg = _decoder(f, act_key)
    f.refuse_if("use_bidirectional_attention", bool, "only causal attention runs")   # transformers 5 has it on all
    return {**cfg, "norm_offset": 1.0, "embedding_scale": math.sqrt(cfg["hidden_size"])}


def _gemma2(f: Fields) -> dict[str, Any]:
    cfg = _gemma(f, act_key="hidden_activation")       # Gemma 2/3's MLP uses hidden_activation
    return {**cfg, "norm_placement": "sandwich", "attention_scale": f.get("query_pre_attn_scalar") ** -0.5,
            "attn_softcap": f.get("attn_logit_softcapping"), "final_softcap": f.get("final_logit_softcapping"),
            "layer_windows": _windows(f, cfg["num_hidden_layers"], per_layer=True)}


def _gemma3(f: Fields) -> dict[str, Any]:
    return {**_gemma2(f), "qk_norm": "head", "local_rope_theta": f.get("rope_local_base_freq", 10000.0)}


def _phi3(f: Fields) -> dict[str, Any]:
    cfg = _mistral(f)
    return {**cfg, "partial_rotary_factor": float(f.get("partial_rotary_factor", 1.0)),
            "original_max_position_embeddings": f.get("original_max_position_embeddings")}


def _olmo2(f: Fields) -> dict[str, Any]:
    return {**_decoder(f), "norm_placement": "post", "qk_norm": "full"}


def _granite(f: Fields) -> dict[str, Any]:
    return {**_decoder(f), "embedding_scale": float(f.get("embedding_multiplier", 1.0)),
            "residual_scale": float(f.get("residual_multiplier", 1.0)),
            "attention_scale": float(f.get("attention_multiplier", 1.0)),
            "logits_scale": 1.0 / float(f.get("logits_scaling", 1.0))}


def _mixtral(f: Fields) -> dict[str, Any]:
    cfg = _mistral(f)
    f.get("router_jitter_noise")                      # multiplies the input by noise only while training
    moe = MoESpec(f.get("num_local_experts"), f.get("num_experts_per_tok"), cfg["intermediate_size"], True,
                  "block_sparse_moe", tuple(range(cfg["num_hidden_layers"])))
    return {**cfg, "moe": moe}


def _qwen3_moe(f: Fields) -> dict[str, Any]:
    cfg = _qwen3(f)
    experts = f.get("num_experts") or f.get("num_local_experts", 0)     # transformers 5 renames it
    step, dense = f.get("decoder_sparse_step", 1), f.get("mlp_only_layers", [])
    moe = MoESpec(experts, f.get("num_experts_per_tok"), f.get("moe_intermediate_size"),
                  bool(f.get("norm_topk_prob", False)), "mlp", _sparse_layers(cfg, experts, step, dense))
    return {**cfg, "moe": moe}


def _sparse_layers(cfg: dict[str, Any], experts: int, step: int, dense: list[int]) -> tuple[int, ...]:
    """Qwen-MoE's MoE layers, as transformers' decoder layer picks them."""
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and experts > 0 and (i + 1) % step == 0)


def _qwen2_moe(f: Fields) -> dict[str, Any]:
    cfg = _decoder(f)
    # transformers' eager/sdpa masks window every layer, its flash path only those past max_window_layers: no oracle
    f.refuse_if("use_sliding_window", bool, "transformers' own Qwen2-MoE windows differ by attention implementation")
    f.get("sliding_window"), f.get("max_window_layers")     # unused without use_sliding_window
    f.refuse_if("layer_types", lambda v: set(v) - {"full_attention"}, "Qwen2-MoE runs full attention only")
    f.refuse_if("shared_expert_intermediate_size", lambda v: v <= 0, "the shared expert must have a width")
    experts, step, dense = f.get("num_experts", 0), f.get("decoder_sparse_step", 1), f.get("mlp_only_layers", [])
    moe = MoESpec(experts, f.get("num_experts_per_tok"), f.get("moe_intermediate_size"),
                  bool(f.get("norm_topk_prob", False)), "mlp", _sparse_layers(cfg, experts, step, dense),
                  shared_intermediate_size=f.get("shared_expert_intermediate_size"))
    return {**cfg, "attention_bias": bool(f.get("qkv_bias", True)), "o_bias": False, "moe": moe}


def _qwen2_5_vl(f: Fields) -> dict[str, Any]:
    """Qwen2.5-VL: a Qwen2 decoder (text_config, audited as its own family) with M-RoPE, plus a vision tower run by
    transformers' own module (model/qwen2_5_vl.py; its config is passed whole: the module reads every field)."""
    text = Fields(to_v4_rope(f.get("text_config")), "qwen2_5_vl_text")
    cfg = _qwen2(text)
    scaling = dict(cfg["rope_scaling"] or {})
    section = scaling.pop("mrope_section", None)
    if section is None:
        raise ValueError("config.json text_config.rope_scaling has no mrope_section: Qwen2.5-VL needs M-RoPE")
    if sum(section) * 2 != cfg["head_dim"]:
        raise ValueError(f"mrope_section {section} must cover head_dim {cfg['head_dim']} (twice its sum)")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") != "default":
        raise ValueError(f"Qwen2.5-VL rope_type {scaling['rope_type']!r}: only the default M-RoPE runs")
    _refuse_unaccounted(text)
    for key in ("pruned_heads", "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
                "tie_encoder_decoder"):
        f.refuse_if(key, bool, "steploop runs decoder-only models with every head")
    f.get("video_token_id")          # videos are refused by the gateway, never encoded
    f.get("tie_word_embeddings")     # transformers ties by text_config's (get_text_config), which _qwen2 read
    vision = dict(f.get("vision_config"))
    return {**cfg, "rope_scaling": None, "mrope_section": tuple(section), "vision_config": vision,
            "image_token_id": f.get("image_token_id"), "vision_start_token_id": f.get("vision_start_token_id"),
            "vision_end_token_id": f.get("vision_end_token_id"), "model_type": f.model_type}


def _gemma3_vlm(f: Fields) -> dict[str, Any]:
    """Gemma 3 with images: the Gemma 3 text decoder (text_config, audited as gemma3_text) plus transformers' own
    SigLIP tower and projector (model/gemma3_vlm.py; the vision config is passed whole: the modules read it)."""
    text = Fields(to_v4_rope(f.get("text_config")), "gemma3_text")
    cfg = _gemma3(text)
    _refuse_unaccounted(text)
    for key in ("pruned_heads", "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
                "tie_encoder_decoder"):
        f.refuse_if(key, bool, "steploop runs decoder-only models with every head")
    vision = dict(f.get("vision_config"))
    tokens = int(f.get("mm_tokens_per_image", 256))
    side, patches = int(tokens ** 0.5), vision.get("image_size", 224) // vision.get("patch_size", 14)
    if side * side != tokens or patches % side:
        raise ValueError(f"mm_tokens_per_image={tokens} must be a square whose side divides the tower's "
                         f"{patches} patches per side (the projector average-pools to it)")
    f.get("boi_token_index"), f.get("eoi_token_index")   # the chat template's tokens around an image: text here
    f.get("tie_word_embeddings")     # transformers ties by text_config's (get_text_config), which _gemma3 read
    return {**cfg, "vision_config": vision, "image_token_id": f.get("image_token_index"),
            "mm_tokens_per_image": tokens, "model_type": f.model_type}


def _refuse_unaccounted(f: Fields) -> None:
    set_fields = [k for k in f.unaccounted() if f.values[k] not in (None, False, 0, "", [], {})]
    if set_fields:
        shown = ", ".join(f"{k}={f.values[k]!r}" for k in set_fields)
        raise ValueError(f"config.json sets {shown}, which steploop does not implement for model_type "
                         f"{f.model_type!r}; refusing rather than serving different output")


FAMILIES: dict[str, Callable[[Fields], dict[str, Any]]] = {
    "llama": _llama, "mistral": _mistral, "ministral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
    "gemma": _gemma, "gemma2": _gemma2, "gemma3_text": _gemma3, "phi3": _phi3, "olmo2": _olmo2,
    "granite": _granite, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe,
    "qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3_vlm,
}


def read_fields(values: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """(ModelConfig kwargs, the Fields record) from a config's to_dict(); raises ValueError on a refusal."""
    model_type = values.get("model_type", "")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; steploop runs {', '.join(FAMILIES)}")
    f = Fields(to_v4_rope(values), model_type)        # transformers 5's rope_parameters, as v4 fields
    kwargs = FAMILIES[model_type](f)
    _refuse_unaccounted(f)
    return kwargs, f


def parse_config(path: pathlib.Path) -> dict[str, Any]:
    """ModelConfig kwargs (without eos ids) for the folder's config.json."""
    from transformers import AutoConfig
    # The family is checked on the raw file first: transformers' own config class for an unsupported family can
    # reject fields a supported one has (FalconConfig.head_dim is a read-only property), which would hide the
    # real reason behind a traceback.
    try:
        raw_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: config.json cannot be read: {exc}") from exc
    if raw_type not in FAMILIES:
        raise ValueError(f"model_type {raw_type!r} is not supported; steploop runs {', '.join(FAMILIES)}")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError, AttributeError, TypeError) as exc:
        raise ValueError(f"{path}: config.json cannot be read by transformers: {exc}") from exc
    values = config.to_dict()
    quant = values.pop("quantization_config", None)
    kwargs = read_fields(values)[0]
    if quant:
        from steploop.gpu_worker.model.quant.config import read_quant_config
        kwargs["quant"] = read_quant_config(quant if isinstance(quant, dict) else quant.to_dict())
    return kwargs
