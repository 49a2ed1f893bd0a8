"""--kv-cache-dtype fp8 through the worker (the Triton backend under the interpreter; compiled on a GPU): a Qwen2
checkpoint carrying llm-compressor's per-layer k_scale / v_scale serves the greedy tokens and logprobs of
transformers fp32 whose keys (after rope) and values are rounded through e4m3 at those scales, as the cache stores
them, chunked and preempted; the cache holds 8-bit blocks; the same run unrounded differs (the rounding is real).

Held to logprobs within 5e-2, as FP8 W8A8 is (tests/worker/test_quant_e2e.py): a K or V value within fp32
reordering of an e4m3 rounding boundary rounds one way here and the other way in the oracle, one whole e4m3 step
(1/16 of it). Measured 2026-12-04: 1e-7 relative noise on the oracle's K and V flipped 4 of 532480 roundings over 20
runs and moved a logprob by up to 1.6e-2; on this CPU the two agree within 1e-4, on another one's matmul order they
need not. A pick may differ only where the oracle's top two are that close."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from steploop.gpu_worker import kv_cache_dtype
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model_runner import ModelRunner
from tests.kernels.conftest import DEVICE
from tests.kernels.short_serve import PROMPTS, generate, serve
from tests.worker.test_quant_e2e import assert_follows_oracle
from tests.worker.family_models import build_family_model, load_oracle

pytestmark = pytest.mark.slow     # the interpreter: about 10 s on 2 shared cores

K_SCALE, V_SCALE = 0.03, 0.02


def _with_kv_scales(path, num_layers: int) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    for i in range(num_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(K_SCALE)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(V_SCALE)
    save_file(tensors, file, metadata={"format": "pt"})


def _fp8_oracle(hf_model):
    """transformers with K (after rope) and V rounded through the cache's e4m3 at the checkpoint's scales."""
    from transformers.models.qwen2 import modeling_qwen2

    def rounded(x, scale):
        s = torch.tensor(scale)
        return kv_cache_dtype.dequantize(kv_cache_dtype.quantize(x, s, torch.float8_e4m3fn), s)

    rope = modeling_qwen2.apply_rotary_pos_emb

    def rope_then_round(q, k, *args, **kwargs):
        q, k = rope(q, k, *args, **kwargs)
        return q, rounded(k, K_SCALE)

    for layer in hf_model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out: rounded(out, V_SCALE))
    return rope_then_round


def test_fp8_kv_cache_equals_transformers_with_rounded_kv(tmp_path, model_dir, monkeypatch):
    from steploop.common import envs
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")
    path = build_family_model("qwen2", tmp_path, model_dir)
    hf_model = load_oracle(path)
    plain = [generate(hf_model, p) for p in PROMPTS]
    _with_kv_scales(path, hf_model.config.num_hidden_layers)
    from transformers.models.qwen2 import modeling_qwen2
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", _fp8_oracle(hf_model))
    expected = [generate(hf_model, p) for p in PROMPTS]
    assert max(abs(a - b) for (_, x), (_, y) in zip(plain, expected) for a, b in zip(x, y)) > 1e-4   # it rounds

    config = WorkerConfig(model=str(path), num_kv_blocks=32, max_model_len=128, device=DEVICE.type, dtype="float32",
                          attention_backend="triton", cuda_graphs=False, kv_cache_dtype="fp8")
    runner = ModelRunner.from_config(config, path)
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    assert runner.info.kv_cache_dtype == "float8_e4m3fn"
    k_scale, v_scale = runner.model.backend.kv_scales[1]
    assert (k_scale.item(), v_scale.item()) == pytest.approx((K_SCALE, V_SCALE))
    for chunk, preempt_after in ((512, None), (7, 4)):
        got = serve(runner, chunk, preempt_after)
        for handle, prompt in enumerate(PROMPTS):
            tokens, logprobs = got[handle]
            assert_follows_oracle(hf_model, list(prompt), tokens, logprobs, 5e-2, f"prompt {handle}, chunk {chunk}")
