"""--kv-cache-dtype fp8 through the worker (the Triton backend under the interpreter; compiled on a GPU): a Qwen2
checkpoint carrying llm-compressor's per-layer k_scale / v_scale serves greedy tokens and logprobs equal to
transformers fp32 whose keys (after rope) and values are rounded through e4m3 at those scales, as the cache stores
them, chunked and preempted; the cache holds 8-bit blocks; the same run at fp32 differs (the rounding is real)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker import kv_cache_dtype
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model_runner import ModelRunner
from tests.kernels.conftest import DEVICE
from tests.worker.driver import Driver
from tests.worker.family_models import build_family_model, load_oracle

pytestmark = pytest.mark.slow     # the interpreter: about 10 s on 2 shared cores

K_SCALE, V_SCALE = 0.03, 0.02
PROMPTS = ([5, 17, 300, 41, 9, 2048, 77, 12, 600, 33, 8, 1000, 3, 71, 99, 100, 4, 23, 5],
           [11, 250, 7, 9000, 64, 31, 2, 18, 404, 5, 80, 6, 1200, 44, 15, 3, 700, 28, 90, 16, 8, 47, 300])
NEW_TOKENS = 6


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


def _generate(hf_model, prompt):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]


def _serve(runner, chunk: int, preempt_after: int | None):
    driver = Driver(runner)
    for handle, prompt in enumerate(PROMPTS):
        driver.add(handle, list(prompt), NEW_TOKENS,
                   SamplingParams(temperature=0.0, logprobs=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    logprobs: dict[int, list[float]] = {h: [] for h in range(len(PROMPTS))}
    for step in range(200):
        if not driver.requests:
            break
        if step == preempt_after and 1 in driver.requests:
            driver.preempt(1)
        for handle, lps in driver.step(chunk).logprobs.items():
            logprobs[handle].extend(lp.logprob for lp in lps)
    runner.reset()
    return {h: (driver.outputs[h], logprobs[h][-NEW_TOKENS:]) for h in logprobs}


def test_fp8_kv_cache_equals_transformers_with_rounded_kv(tmp_path, model_dir, monkeypatch):
    from steploop.common import envs
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")
    path = build_family_model("qwen2", tmp_path, model_dir)
    hf_model = load_oracle(path)
    plain = [_generate(hf_model, p) for p in PROMPTS]
    _with_kv_scales(path, hf_model.config.num_hidden_layers)
    from transformers.models.qwen2 import modeling_qwen2
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", _fp8_oracle(hf_model))
    expected = [_generate(hf_model, p) for p in PROMPTS]
    assert max(abs(a - b) for (_, x), (_, y) in zip(plain, expected) for a, b in zip(x, y)) > 1e-4   # it rounds

    config = WorkerConfig(model=str(path), num_kv_blocks=32, max_model_len=128, device=DEVICE.type, dtype="float32",
                          attention_backend="triton", cuda_graphs=False, kv_cache_dtype="fp8")
    runner = ModelRunner.from_config(config, path)
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    assert runner.info.kv_cache_dtype == "float8_e4m3fn"
    k_scale, v_scale = runner.model.backend.kv_scales[1]
    assert (k_scale.item(), v_scale.item()) == pytest.approx((K_SCALE, V_SCALE))
    for chunk, preempt_after in ((512, None), (7, 4)):
        got = _serve(runner, chunk, preempt_after)
        for handle, (want_tokens, want_logprobs) in enumerate(expected):
            tokens, logprobs = got[handle]
            assert tokens == want_tokens, f"prompt {handle}, chunk {chunk}"
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"prompt {handle}, chunk {chunk}"
