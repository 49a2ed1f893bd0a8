"""Pipeline-parallel test fixtures: the tensor-parallel tests' (kernel probe off, small random Llama folders), and
the random models the stage tests serve with transformers' answers."""

from __future__ import annotations

import pytest
import torch

from steploop.common import envs
from tests.tp.tp_models import build_llama
from tests.worker.family_models import build_family_model, load_oracle
from tests.worker.test_families import oracle, prompts


@pytest.fixture(autouse=True)
def no_kernel_probe(monkeypatch):
    """The packed-vs-torch probe is off in unit tests (tests/worker/conftest.py says why); stages use torch."""
    monkeypatch.setenv(envs.CPU_KERNEL_PROBE, "0")


@pytest.fixture(scope="session")
def pp_llama_dir(tmp_path_factory, model_dir):
    """LlamaConfig, 2 layers (one per stage at -pp 2), 4 heads / 2 KV heads, untied embeddings."""
    return build_llama(tmp_path_factory.mktemp("pp-llama"), model_dir, num_heads=4, num_kv_heads=2, tied=False)


BUILDERS = {"llama": lambda out, tok: build_llama(out, tok, 4, 2, tied=False),
            "llama_tied": lambda out, tok: build_llama(out, tok, 4, 1, tied=True),
            # bf16: each stage (and rank) keeps its share of the linears at 16 bits (model/half_weights.py)
            "llama_bf16": lambda out, tok: build_llama(out, tok, 4, 2, tied=False, dtype=torch.bfloat16),
            "mixtral": lambda out, tok: build_family_model("mixtral", out, tok),
            "qwen3_moe": lambda out, tok: build_family_model("qwen3_moe", out, tok)}


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dir):
    """name -> (folder, transformers' (tokens, logprobs) per prompt), built when a case first asks."""
    built: dict = {}

    def get(name: str):
        if name not in built:
            path = BUILDERS[name](tmp_path_factory.mktemp(f"pp-{name}"), model_dir)
            hf_model = load_oracle(path)
            built[name] = path, [oracle(hf_model, p) for p in prompts()]
        return built[name]
    return get
