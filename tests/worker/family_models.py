"""Small random models of each supported family, built from transformers' own config classes and saved as a
HuggingFace folder (config.json, model.safetensors, the default model's tokenizer), plus the transformers oracle.

Shapes vary on purpose: layer counts 2-4, GQA ratios 1, 2 and 4, head sizes 64 and 128, tied and untied
embeddings, an MLP width that is not a multiple of 32. Windows are short (16-24 tokens) so the test prompts (40+ tokens) cross them.
"""

from __future__ import annotations

import pathlib
import shutil

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
VOCAB = 49152   # the default model's tokenizer
WINDOW = 16

_COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 512, "initializer_range": 0.2, "rms_norm_eps": 1e-6,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

# family -> (config class name, kwargs)
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama_gelu": ("LlamaConfig", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                                   "hidden_act": "gelu", "tie_word_embeddings": False,
                                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 128}}),
    "mistral": ("MistralConfig", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
                                  "sliding_window": WINDOW, "tie_word_embeddings": False}),
    "ministral": ("MinistralConfig", {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4,
                                      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                                      "sliding_window": WINDOW, "tie_word_embeddings": True,
                                      "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "qwen2": ("Qwen2Config", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": True,
                              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    # 200: also off the packed grid; test_families_e2e serves it in a real worker, start-up probe included
    "qwen2_window": ("Qwen2Config", {"hidden_size": 128, "intermediate_size": 200, "num_hidden_layers": 3,
                                     "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False,
                                     "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                              "tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "gemma": ("GemmaConfig", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}),
    "gemma2": ("Gemma2Config", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                                "sliding_window": WINDOW, "query_pre_attn_scalar": 48,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                                    "sliding_window": WINDOW, "query_pre_attn_scalar": 128, "sliding_window_pattern": 2,
                                    "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "phi3": ("Phi3Config", {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
                            "partial_rotary_factor": 0.75, "original_max_position_embeddings": 256,
                            "sliding_window": 24,
                            "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 24 for i in range(24)],
                                             "long_factor": [2.0 + i / 12 for i in range(24)]}}),
    # 136: a down_proj the packed CPU layout cannot hold (in_features % 32), which the start-up probe must skip
    "olmo2": ("Olmo2Config", {"hidden_size": 128, "intermediate_size": 136, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": False,
                              "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "granite": ("GraniteConfig", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                                  "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True,
                                  "embedding_multiplier": 6.0, "attention_multiplier": 0.03, "residual_multiplier": 0.4,
                                  "logits_scaling": 4.0,
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mixtral": ("MixtralConfig", {"hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                                  "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                                  "tie_word_embeddings": False}),
    "qwen3_moe": ("Qwen3MoeConfig", {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
                                     "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
                                     "head_dim": 128, "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False,
                                     "decoder_sparse_step": 1, "mlp_only_layers": [1], "tie_word_embeddings": False}),
    "qwen2_moe": ("Qwen2MoeConfig", {"hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64,
                                     "shared_expert_intermediate_size": 96, "num_hidden_layers": 4,
                                     "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 6,
                                     "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 2,
                                     "mlp_only_layers": [3], "tie_word_embeddings": True}),
}


def make_config(family: str):
    import transformers
    name, kwargs = FAMILY_CONFIGS[family]
    return getattr(transformers, name)(**{**_COMMON, **kwargs})


def build_family_model(family: str, out: pathlib.Path, tokenizer_dir: pathlib.Path, seed: int = 0,
                       dtype: torch.dtype = torch.float32, max_shard_size: str = "5GB") -> pathlib.Path:
    """Random weights from the family's config class, saved (in `dtype`, sharded past max_shard_size) with the
    default model's tokenizer."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family), dtype=torch.float32)
    with torch.no_grad():     # the norms start at exactly 1 (0 for Gemma): make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(out, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def load_oracle(path: pathlib.Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
