"""transformers 5 config forms (rope_parameters) resolve to the same ModelConfig as the transformers 4 forms.

The GPU machine runs transformers 5, where rope_theta / rope_scaling / rope_local_base_freq / partial_rotary_factor
live inside rope_parameters (per layer type for Gemma 3) and Qwen3-MoE's num_experts is num_local_experts. These
tests build the v5 dicts from the v4 config classes installed here, as transformers 5.17 writes them (shapes
checked against 5.17's to_dict()), and parse config.json files written by 5.17 through AutoConfig.
"""

from __future__ import annotations

import json

import pytest
import transformers

from steploop.gpu_worker.model.families import parse_config, read_fields
from steploop.gpu_worker.model.model_config import ModelConfig
from steploop.gpu_worker.model.rotary import RopeSpec, inverse_frequencies

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
YARN_FULL = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0,
             "mscale_all_dim": 0.5, "truncate": False, "original_max_position_embeddings": 2048}
LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 36 for i in range(36)],
            "long_factor": [2.0 + i / 9 for i in range(36)]}

CASES = [
    ("LlamaConfig", {}),
    ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA3, "max_position_embeddings": 131072}),
    ("LlamaConfig", {"rope_scaling": YARN, "max_position_embeddings": 4096}),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("Qwen2Config", {"rope_theta": 1e6, "rope_scaling": YARN_FULL, "use_sliding_window": True, "sliding_window": 32,
                     "max_window_layers": 2, "num_hidden_layers": 4}),
    ("MistralConfig", {"rope_theta": 1e6, "sliding_window": 4096}),
    ("Qwen3Config", {"rope_theta": 1e6, "rope_scaling": YARN}),
    ("Gemma2Config", {"num_hidden_layers": 4}),
    ("Gemma3TextConfig", {"num_hidden_layers": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ("Phi3Config", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024, "hidden_size": 768,
                    "num_attention_heads": 8, "max_position_embeddings": 8192, "rope_scaling": LONGROPE}),
    ("MixtralConfig", {"num_hidden_layers": 2}),
    ("Qwen3MoeConfig", {"num_hidden_layers": 2, "num_experts": 16}),
    ("Qwen2MoeConfig", {"num_hidden_layers": 2}),
    ("GraniteConfig", {"rope_theta": 5e6, "residual_multiplier": 0.2}),
    ("Olmo2Config", {"rope_theta": 5e5}),
]


def as_v5(values: dict) -> dict:
    """The dict transformers 5 produces for the same config: the rotary fields folded into rope_parameters."""
    out = dict(values)
    theta, scaling = out.pop("rope_theta", 10000.0), out.pop("rope_scaling", None)
    params = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    if out.get("model_type") == "phi3":
        params["partial_rotary_factor"] = out["partial_rotary_factor"]   # 5.17 keeps it at the top level too
    if out.get("model_type") == "gemma3_text":
        local = out.pop("rope_local_base_freq")
        params = {"full_attention": params, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    if out.get("model_type") == "qwen3_moe":
        out["num_local_experts"] = out.pop("num_experts")
    if out.get("model_type") == "qwen2_moe":
        out["layer_types"] = ["full_attention"] * out["num_hidden_layers"]
    if out.get("model_type") in ("gemma", "gemma2"):
        out["use_bidirectional_attention"] = None
    return {**out, "rope_parameters": params}


@pytest.mark.parametrize("cls, kw", CASES, ids=[f"{c}-{i}" for i, (c, _) in enumerate(CASES)])
def test_v5_dict_resolves_like_v4(cls, kw):
    v4 = getattr(transformers, cls)(**kw).to_dict()
    v5 = as_v5(v4)
    assert "rope_theta" not in v5 and "rope_scaling" not in v5
    got, fields = read_fields(v5)
    want, _ = read_fields(v4)
    assert got == want
    assert fields.unaccounted() == []


def test_v5_values_win_over_v4_defaults_beside_them():
    """transformers 4 loading a v5 config.json keeps rope_parameters as an attribute beside its default
    rope_theta=10000: the v5 values are the model's."""
    v4 = transformers.LlamaConfig().to_dict()
    loaded = {**v4, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}
    kwargs, _ = read_fields(loaded)
    assert kwargs["rope_theta"] == 500000.0 and kwargs["rope_scaling"] == LLAMA3


# config.json as transformers 5.17 writes them (save_pretrained), trimmed to the fields that matter here.
V5_LLAMA3_JSON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                  "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
                  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
                  "bos_token_id": 128000, "eos_token_id": 128001, "dtype": "bfloat16",
                  "transformers_version": "5.17.0",
                  "rope_parameters": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                      "rope_theta": 500000.0}}
V5_GEMMA3_JSON = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 1024,
                  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4,
                  "num_key_value_heads": 1, "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh",
                  "max_position_embeddings": 32768, "query_pre_attn_scalar": 64, "sliding_window": 512,
                  "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "transformers_version": "5.17.0",
                  "use_bidirectional_attention": False,
                  "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                         "rope_theta": 1000000.0}}}


def test_v5_written_config_json_parses_through_auto_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V5_LLAMA3_JSON))
    cfg = parse_config(tmp_path)
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["rope_scaling"]["factor"] == 32.0 and cfg["num_key_value_heads"] == 8
    (tmp_path / "config.json").write_text(json.dumps(V5_GEMMA3_JSON))
    gemma = ModelConfig(**parse_config(tmp_path))
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1000000.0, 10000.0)
    assert gemma.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert gemma.layer_windows == (512,) * 5 + (None,)


def test_v5_llama3_frequencies_equal_v4():
    v4 = transformers.LlamaConfig(rope_theta=500000.0, rope_scaling=LLAMA3, max_position_embeddings=131072)
    specs = []
    for values in (v4.to_dict(), as_v5(v4.to_dict())):
        c = ModelConfig(**read_fields(values)[0])
        specs.append(inverse_frequencies(RopeSpec(c.head_dim, c.rope_theta, c.rope_scaling,
                                                  c.max_position_embeddings), 4096))
    assert specs[0][0].equal(specs[1][0]) and specs[0][1] == specs[1][1]


def test_v4_and_v5_rope_that_disagree_are_refused():
    values = {**transformers.LlamaConfig().to_dict(), "rope_scaling": {"rope_type": "linear", "factor": 2.0},
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="disagree"):
        read_fields(values)


def test_v5_sliding_layers_with_scaled_rope_are_refused():
    v5 = {**V5_GEMMA3_JSON, "rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    with pytest.raises(ValueError, match="sliding_attention"):
        read_fields(v5)
