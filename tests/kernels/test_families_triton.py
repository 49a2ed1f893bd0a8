"""The families whose attention or MLP the new kernels serve, end to end through the worker with the triton backend,
exact against transformers: Mistral (a window on every layer), Gemma 2 (local / global layers, attention
soft-capping), Gemma 3 (local layers with their own rope base) and Mixtral (a window and the fused-MoE kernel).

The same small random models, prompts (longer than the 16-token windows) and oracle as tests/worker/test_families.py,
here under the interpreter (on a GPU compiled), with uneven chunked prefill so chunks attend prior context. The MoE
dispatch is on for CUDA tensors only, so it is switched on here for the CPU tensors the interpreter runs on.
"""

from __future__ import annotations

import pytest

from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model import moe
from steploop.gpu_worker.model_runner import ModelRunner
from tests.kernels.conftest import DEVICE
from tests.worker.family_models import build_family_model, load_oracle
from tests.worker.test_families import oracle, prompts, serve

pytestmark = pytest.mark.slow     # the interpreter: about 1-3 min per family on 2 shared cores


@pytest.fixture(autouse=True)
def no_kernel_probe(monkeypatch):
    from steploop.common import envs
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "mixtral"])
def test_greedy_tokens_and_logprobs_equal_transformers(family, tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(moe, "fused_kernel_serves", lambda x: True)
    path = build_family_model(family, tmp_path, model_dir)
    expected = [oracle(load_oracle(path), p) for p in prompts()]
    config = WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256, device=DEVICE.type,
                          dtype="float32", attention_backend="triton", cuda_graphs=False)
    runner = ModelRunner.from_config(config, path)
    layers = runner.model.model.layers
    assert all(layer.self_attn.windowed is None for layer in layers)       # every layer in the kernel
    assert runner.model.backend.variants                                   # some layer windowed / soft-capped
    got = serve(runner, {0: 7, 1: 64, 2: 5})
    for handle, (want_tokens, want_logprobs) in enumerate(expected):
        tokens, logprobs = got[handle]
        assert tokens == want_tokens, f"{family} prompt {handle}: {tokens} != {want_tokens}"
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{family} prompt {handle}"
