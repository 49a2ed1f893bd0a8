"""--kv-cache-dtype: the names vLLM takes, the FP8 scales a checkpoint carries (every form vLLM reads; partial or
per-head ones refused), compressed-tensors' FP8 kv_cache_scheme accepted, a cache a quarter of fp32's bytes per
block, and the refusal where no kernel reads an FP8 cache (the torch backend, the CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from steploop.gpu_worker import kv_cache_dtype
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.kv_cache import bytes_per_block
from steploop.gpu_worker.model.kv_scales import KvScales
from steploop.gpu_worker.model.loader import load_model
from steploop.gpu_worker.model.model_config import LlamaModelConfig
from steploop.gpu_worker.model.quant.config import read_quant_config
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.family_models import build_family_model


def test_names_resolve_as_vllm_and_others_are_refused():
    assert kv_cache_dtype.resolve("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype.resolve("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_dtype.resolve("fp8_e4m3", torch.float16) == torch.float8_e4m3fn
    assert kv_cache_dtype.resolve("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_cache_dtype.resolve("bfloat16", torch.bfloat16) == torch.bfloat16       # vLLM's name for it
    with pytest.raises(ValueError, match="bfloat16 with a float32 model"):
        kv_cache_dtype.resolve("bfloat16", torch.float32)
    with pytest.raises(ValueError, match="--calculate-kv-scales: steploop does not compute FP8 K/V scales"):
        WorkerConfig(kv_cache_dtype="fp8", calculate_kv_scales=True)
    with pytest.raises(ValueError, match="--kv-cache-dtype .int8. is not one of auto, bfloat16, fp8"):
        WorkerConfig(kv_cache_dtype="int8")


def test_quantize_clamps_to_the_format_and_rounds_to_nearest():
    x = torch.tensor([1000.0, -1000.0, 0.3, 1.0])
    q = kv_cache_dtype.quantize(x, torch.tensor([1.0]), torch.float8_e4m3fn)
    assert q.float().tolist() == [448.0, -448.0, 0.3125, 1.0]
    assert kv_cache_dtype.dequantize(kv_cache_dtype.quantize(x, torch.tensor([4.0]), torch.float8_e4m3fn),
                                     torch.tensor([4.0])).tolist()[:2] == [1024.0, -1024.0]   # 1000/4 -> 256


def test_an_fp8_block_is_a_quarter_of_an_fp32_one():
    cfg = LlamaModelConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                           rope_theta=1e4, max_position_embeddings=128, tie_word_embeddings=True)
    fp32, fp8 = (bytes_per_block(cfg, 16, dt) for dt in (torch.float32, torch.float8_e4m3fn))
    assert fp32 == 4 * fp8 and bytes_per_block(cfg, 16, torch.bfloat16) == 2 * fp8


@pytest.mark.parametrize("names", [
    ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),
    ("model.layers.{i}.self_attn.attn.k_scale", "model.layers.{i}.self_attn.attn.v_scale"),
    ("model.layers.{i}.self_attn.k_proj.output_scale", "model.layers.{i}.self_attn.v_proj.output_scale"),
])
def test_each_stored_form_of_the_scales_is_read(names):
    scales = KvScales()
    for i in range(2):
        assert scales.take(names[0].format(i=i), lambda i=i: torch.tensor([0.5 + i]))
        assert scales.take(names[1].format(i=i), lambda i=i: torch.tensor(0.25 * (i + 1)))
    assert not scales.take("model.layers.0.self_attn.k_proj.weight", lambda: pytest.fail("read a weight"))
    assert scales.for_layers(2) == ({0: (0.5, 0.25), 1: (1.5, 0.5)}, "the checkpoint's")


def test_one_kv_scale_serves_both_and_bad_ones_are_refused():
    scales = KvScales()
    scales.take("model.layers.0.self_attn.kv_scale", lambda: torch.tensor(0.125))
    assert scales.for_layers(1)[0] == {0: (0.125, 0.125)}
    assert KvScales().for_layers(2)[0] == {0: (1.0, 1.0), 1: (1.0, 1.0)}       # none stored: 1.0, as vLLM
    with pytest.raises(ValueError, match="not K and V for layers \\[1\\]"):
        scales.for_layers(2)
    with pytest.raises(ValueError, match="one scale per layer"):
        KvScales().take("model.layers.0.self_attn.k_scale", lambda: torch.ones(4))
    with pytest.raises(ValueError, match="positive finite"):
        KvScales().take("model.layers.0.self_attn.v_scale", lambda: torch.tensor(0.0))


def test_compressed_tensors_fp8_kv_cache_scheme_is_accepted_and_others_refused():
    fp8 = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
    group = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False, "symmetric": True},
             "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True,
                                   "symmetric": True}}
    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "kv_cache_scheme": fp8}
    assert read_quant_config(config).kind == "fp8"
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        read_quant_config({**config, "kv_cache_scheme": {**fp8, "dynamic": True}})
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        read_quant_config({**config, "kv_cache_scheme": {**fp8, "type": "int"}})


@pytest.fixture(scope="module")
def qwen2_with_scales(tmp_path_factory, model_dir):
    path = build_family_model("qwen2", tmp_path_factory.mktemp("qwen2"), model_dir)
    tensors = load_file(path / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.03)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_checkpoint_with_kv_scales_loads_at_any_cache_dtype(qwen2_with_scales):
    model = load_model(qwen2_with_scales, create_backend("torch", 2, 2, 64, 0.125), 128, torch.float32,
                       torch.device("cpu"))
    assert model.kv_scales.for_layers(2)[0] == {0: pytest.approx((0.03, 0.02)), 1: pytest.approx((0.03, 0.02))}


def test_the_cpu_worker_refuses_an_fp8_cache_before_loading(qwen2_with_scales, caplog):
    config = WorkerConfig(model=str(qwen2_with_scales), num_kv_blocks=16, max_model_len=64, device="cpu",
                          kv_cache_dtype="fp8")
    with caplog.at_level("INFO"), pytest.raises(ValueError, match="only the Triton attention kernels read an FP8 KV "
                                                                  "cache \\(CUDA\\); this worker runs the torch"):
        ModelRunner.from_config(config, qwen2_with_scales)
    assert "loading model" not in caplog.text
