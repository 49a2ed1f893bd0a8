"""A Qwen2-MoE / Qwen3-MoE GGUF file's config as llama.cpp reads its metadata, where transformers' GGUF reader
(4.57) falls short: it never reads the experts' width (`expert_feed_forward_length`, the shared expert's
`expert_shared_feed_forward_length`), and for qwen2moe none of the architecture's keys at all (its table is keyed
"qwen2moe" but looked up as "qwen2_moe"), leaving the config class's defaults (60 experts of 1408) in place of the
file's. llama.cpp's Qwen3-MoE always renormalises the top-k weights (Qwen3-MoE's own norm_topk_prob), its
Qwen2-MoE never does; `expert_weights_norm`, where a file has it, says so explicitly.

    config.update(moe_config(reader))      # {} for any other architecture

A llama-architecture file with experts (`llama.expert_count`: Mixtral, as llama.cpp converts it) is a Mixtral,
which transformers' reader takes for a dense Llama: mixtral_config makes its MixtralConfig (the experts' width is
the file's feed_forward_length; Mixtral always renormalises; no sliding window, as llama.cpp runs it).
"""

from __future__ import annotations

from gguf import GGUFReader

MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")

# GGUF key (after "<arch>.") -> HF config field
_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
         "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
         "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
         "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
         "attention.key_length": "head_dim", "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
         "expert_feed_forward_length": "moe_intermediate_size",
         "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
         "expert_weights_norm": "norm_topk_prob"}
_RENORMALIZE = {"qwen2moe": False, "qwen3moe": True}


def _value(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]].tolist()
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def moe_config(reader: GGUFReader, arch: str) -> dict:
    """The config fields the file's metadata sets for a MoE architecture; {} for any other."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    out = {"norm_topk_prob": _RENORMALIZE[arch], "mlp_only_layers": [], "decoder_sparse_step": 1}   # every layer MoE
    for key, name in _KEYS.items():
        value = _value(reader, f"{arch}.{key}")
        if value is not None:
            out[name] = bool(value) if name == "norm_topk_prob" else value
    if arch == "qwen2moe" and "head_dim" in out:      # Qwen2-MoE derives it from hidden_size / heads
        del out["head_dim"]
    return out


def mixtral_config(reader: GGUFReader, arch: str, llama_config):
    """A MixtralConfig for a llama-arch file with experts (from transformers' LlamaConfig of it); None otherwise."""
    experts = _value(reader, f"{arch}.expert_count")
    if arch != "llama" or not experts:
        return None
    from transformers import MixtralConfig
    known = MixtralConfig().to_dict()
    fields = {k: v for k, v in llama_config.to_dict().items()
              if k in known and k not in ("model_type", "architectures", "transformers_version", "dtype",
                                          "torch_dtype", "sliding_window")}
    return MixtralConfig(**fields, num_local_experts=int(experts),
                         num_experts_per_tok=int(_value(reader, f"{arch}.expert_used_count")), sliding_window=None)
