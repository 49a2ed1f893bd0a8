"""Pipeline-parallel test fixtures: the tensor-parallel tests' (kernel probe off, small random Llama folders)."""

from __future__ import annotations

import pytest

from steploop.common import envs


@pytest.fixture(autouse=True)
def no_kernel_probe(monkeypatch):
    """The packed-vs-torch probe is off in unit tests (tests/worker/conftest.py says why); stages use torch."""
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")


@pytest.fixture(scope="session")
def pp_llama_dir(tmp_path_factory, model_dir):
    """LlamaConfig, 2 layers (one per stage at -pp 2), 4 heads / 2 KV heads, untied embeddings."""
    from tests.tp.tp_models import build_llama
    return build_llama(tmp_path_factory.mktemp("pp-llama"), model_dir, num_heads=4, num_kv_heads=2, tied=False)
