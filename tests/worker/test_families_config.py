"""Config parsing per family: every field of each supported family's transformers config class is either read or
documented as inert; anything else that is set is refused (exit 2, before any weight loads); rope frequencies and
attention factors equal transformers' ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from steploop.gpu_worker.model.families import FAMILIES, INERT_FIELDS, read_fields
from steploop.gpu_worker.model.model_config import ModelConfig
from steploop.gpu_worker.model.rotary import RopeSpec, inverse_frequencies
from tests.worker.family_models import TOKENIZER_FILES

CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "ministral": "MinistralConfig",
                  "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
                  "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config", "olmo2": "Olmo2Config",
                  "granite": "GraniteConfig", "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig",
                  "qwen2_moe": "Qwen2MoeConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "gemma3": "Gemma3Config"}
# Constructor arguments a family needs to be servable at all (Qwen2.5-VL: its M-RoPE split, as every checkpoint has;
# Gemma 3: a SigLIP of 896 / 14 = 64 patches a side, which pools to 256 tokens, as every checkpoint has).
CONFIG_KWARGS = {"qwen2_5_vl": {"text_config": {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}},
                 "gemma3": {"vision_config": {"image_size": 896, "patch_size": 14, "vision_use_head": False}}}


def test_every_family_has_its_config_class():
    assert set(CONFIG_CLASSES) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_config_field_is_read_or_documented_inert(model_type):
    values = getattr(transformers, CONFIG_CLASSES[model_type])(**CONFIG_KWARGS.get(model_type, {})).to_dict()
    _, fields = read_fields(values)
    assert fields.unaccounted() == [], (f"{model_type}: fields neither read nor in INERT_FIELDS: "
                                        f"{fields.unaccounted()}")
    read_and_inert = {k for k in fields.read if k in INERT_FIELDS}
    assert not read_and_inert, f"fields both read and listed inert: {read_and_inert}"


@pytest.mark.parametrize("change, named", [
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_scaling="),
    ({"sliding_window": 64}, "sliding_window=64"),                     # Llama has no window: not silently ignored
    ({"some_new_switch": True}, "some_new_switch=True"),              # an unknown field that is set
    ({"pruned_heads": {"0": [1]}}, "pruned_heads="),
])
def test_math_changing_fields_are_refused_with_their_name(change, named):
    values = {**transformers.LlamaConfig().to_dict(), **change}
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        read_fields(values)


def test_unset_unknown_fields_are_accepted():
    kwargs, _ = read_fields({**transformers.LlamaConfig().to_dict(), "use_mrope": False, "extra": None})
    assert kwargs["hidden_act"] == "silu"


def test_family_differences_are_declared():
    def parse(cls, **kw):
        kwargs, _ = read_fields(getattr(transformers, cls)(**kw).to_dict())
        return ModelConfig(**kwargs)

    assert parse("LlamaConfig").is_plain_llama
    qwen2 = parse("Qwen2Config", use_sliding_window=True, sliding_window=32, max_window_layers=2,
                  num_hidden_layers=4)
    assert (qwen2.attention_bias, qwen2.output_bias, qwen2.layer_windows) == (True, False, (None, None, 32, 32))
    gemma2 = parse("Gemma2Config", num_hidden_layers=4, sliding_window=64)
    assert gemma2.layer_windows == (64, None, 64, None) and gemma2.norm_placement == "sandwich"
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.norm_offset) == (50.0, 30.0, 1.0)
    gemma3 = parse("Gemma3TextConfig", num_hidden_layers=6, sliding_window_pattern=3)
    assert gemma3.layer_windows == (4096, 4096, None) * 2 and gemma3.qk_norm == "head"
    assert parse("Olmo2Config").norm_placement == "post" and parse("Olmo2Config").qk_norm == "full"
    granite = parse("GraniteConfig", logits_scaling=8.0, residual_multiplier=0.2)
    assert (granite.logits_scale, granite.residual_scale) == (0.125, 0.2)
    assert not parse("MistralConfig", sliding_window=4096).is_plain_llama
    qwen2_moe = parse("Qwen2MoeConfig", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert (qwen2_moe.attention_bias, qwen2_moe.output_bias, qwen2_moe.moe.sparse_layers) == (True, False, (1,))
    assert qwen2_moe.moe.shared_intermediate_size == 5632 and not qwen2_moe.moe.renormalize


def test_qwen2_moe_window_is_refused():
    """transformers' own Qwen2-MoE windows every layer under eager/sdpa but only the upper ones under flash."""
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        read_fields(transformers.Qwen2MoeConfig(use_sliding_window=True, sliding_window=64).to_dict())


ROPE_CASES = [
    ("LlamaConfig", {}),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                                      "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}}),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "rope_theta": 500000.0}),
    ("Phi3Config", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024,
                    "max_position_embeddings": 8192,
                    "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 36 for i in range(36)],
                                     "long_factor": [2.0 + i / 9 for i in range(36)]}}),
]


@pytest.mark.parametrize("cls, kw", ROPE_CASES)
def test_rope_frequencies_match_transformers(cls, kw):
    hf = getattr(transformers, cls)(hidden_size=768, num_attention_heads=8,
                                    **{"max_position_embeddings": 4096, **kw})
    kwargs, _ = read_fields(hf.to_dict())
    cfg = ModelConfig(**kwargs)
    spec = RopeSpec(int(cfg.head_dim * cfg.partial_rotary_factor), cfg.rope_theta, cfg.rope_scaling,
                    cfg.max_position_embeddings, cfg.original_max_position_embeddings)
    kind = (hf.rope_scaling or {}).get("rope_type") or (hf.rope_scaling or {}).get("type") or "default"
    for max_len in {cfg.original_max_position_embeddings or cfg.max_position_embeddings, cfg.max_position_embeddings}:
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=max_len) if kind == "longrope" \
            else ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        got, got_factor = inverse_frequencies(spec, max_len)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert got_factor == pytest.approx(want_factor, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("change, named", [({"hidden_act": "relu"}, "hidden_act='relu'"),
                                           ({"model_type": "falcon"}, "falcon")])
def test_refused_config_exits_2_before_loading_weights(tmp_path, model_dir, change, named):
    """A folder without weights: the worker names the field and exits 2 without looking for them."""
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({**transformers.LlamaConfig(num_hidden_layers=2).to_dict(),
                                                      **change}))
    proc = subprocess.run([sys.executable, "-m", "steploop.gpu_worker", "--model", str(tmp_path), "--device", "cpu"],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "safetensors" not in proc.stderr


def test_kernel_plan_routes_family_differences_to_torch():
    """The C whole-step decoder is plain Llama's, and the plan says why; on CUDA the triton kernel serves windowed /
    soft-capped layers, so they keep CUDA graphs."""
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.kernel_plan import resolve_kernel_plan

    def parse(cls, **kw):
        return ModelConfig(**read_fields(getattr(transformers, cls)(**kw).to_dict())[0])

    config = WorkerConfig(model="unused", device="cpu")
    gemma2 = parse("Gemma2Config")
    plan = resolve_kernel_plan(config, torch.device("cpu"), torch.float32, gemma2)
    assert not plan.cpu_decoder and "gemma2" in dict(plan.why_off)["C decoder"]
    cuda = WorkerConfig(model="unused", device="cuda")
    assert resolve_kernel_plan(cuda, torch.device("cuda"), torch.bfloat16, gemma2).cuda_graphs   # kernel-served
    assert resolve_kernel_plan(cuda, torch.device("cuda"), torch.bfloat16, parse("Qwen3Config")).cuda_graphs


def test_qwen2_5_vl_without_mrope_section_is_refused():
    with pytest.raises(ValueError, match="mrope_section"):
        read_fields(transformers.Qwen2_5_VLConfig().to_dict())
