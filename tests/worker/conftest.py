"""Worker fixtures: one ModelRunner and one transformers reference model per session (fp32, CPU)."""

from __future__ import annotations

import pytest

from steploop.common import envs


@pytest.fixture(autouse=True)
def no_kernel_probe(monkeypatch):
    """Worker tests choose their kernels themselves: the start-up probe times packed against torch matmuls and, on
    a tiny test model's shapes, the two are within noise of each other, so the plan would vary from run to run.
    The probe has its own tests (test_kernel_probe.py, which unsets this); integration tests run it for real."""
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")


@pytest.fixture(scope="session")
def runner(model_dir):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner

    config = WorkerConfig(model=str(model_dir), num_kv_blocks=256, max_model_len=1024, device="cpu")
    return ModelRunner.from_config(config, model_dir)


@pytest.fixture
def fresh_runner(runner):
    runner.reset()
    yield runner
    runner.reset()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
