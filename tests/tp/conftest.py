"""Tensor-parallel test fixtures: small random Llama models whose heads split by 2, saved as HF folders."""

from __future__ import annotations

import pytest

from steploop.common import envs


@pytest.fixture(autouse=True)
def no_kernel_probe(monkeypatch):
    """The packed-vs-torch probe is off in unit tests (tests/worker/conftest.py says why); TP ranks use torch."""
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")


@pytest.fixture(scope="session")
def tp2_model_dir(tmp_path_factory, model_dir):
    """LlamaConfig, 4 heads / 2 KV heads, untied embeddings: every split dimension divides by 2."""
    from tests.tp.tp_models import build_llama
    return build_llama(tmp_path_factory.mktemp("tp2-llama"), model_dir, num_heads=4, num_kv_heads=2, tied=False)


@pytest.fixture(scope="session")
def tp2_replicated_kv_dir(tmp_path_factory, model_dir):
    """4 heads / 1 KV head, tied embeddings: at -tp 2 the KV head is replicated on both ranks."""
    from tests.tp.tp_models import build_llama
    return build_llama(tmp_path_factory.mktemp("tp2-kv1"), model_dir, num_heads=4, num_kv_heads=1, tied=True)


@pytest.fixture(scope="session")
def hf(model_dir):
    """transformers on the default model: the oracle for -tp 3."""
    from tests.integration.hf_reference import HFReference
    return HFReference(model_dir)
