"""`--model FILE.gguf` for the families transformers' GGUF reader loads: small random HF models written as GGUF
(tests/worker/gguf_files.py), converted by the worker's gguf_convert, served by the ModelRunner: greedy tokens and
logprobs equal the original HF model's generate. Architectures the reader or steploop cannot run are refused,
naming the architecture, before any tensor is dequantized."""

from __future__ import annotations

import pytest
import torch

from steploop.common.model_path import ModelNotFoundError, gguf_model_dir, resolve_model, served_model_name
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.gguf_convert import convert_gguf
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.family_models import _COMMON
from tests.worker.gguf_files import write_gguf
from tests.worker.test_families import oracle, prompts, serve

_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2}
# What transformers' GGUF reader takes from the metadata: Qwen3's head_dim is not read (its config default, 128,
# which every Qwen3 uses), Gemma 2/3's soft-caps and query_pre_attn_scalar stay at their config defaults.
GGUF_CONFIGS = {
    "llama": ("LlamaConfig", {**_SHAPE, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {**_SHAPE, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {**_SHAPE, "num_key_value_heads": 1, "head_dim": 128, "tie_word_embeddings": False}),
    "gemma2": ("Gemma2Config", {**_SHAPE, "head_dim": 64, "sliding_window": 16, "num_hidden_layers": 4}),
    "gemma3_text": ("Gemma3TextConfig", {**_SHAPE, "head_dim": 64, "sliding_window": 16, "num_hidden_layers": 4}),
    "phi3": ("Phi3Config", {**_SHAPE, "tie_word_embeddings": False}),
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPLOOP_CACHE_DIR", str(tmp_path / "cache"))


def random_model(family: str):
    import transformers
    name, kwargs = GGUF_CONFIGS[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**{**_COMMON, **kwargs}),
                                                          dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(GGUF_CONFIGS))
def test_gguf_file_serves_the_hf_models_greedy_tokens(family, tmp_path, model_dir):
    model = random_model(family)
    gguf = write_gguf(model, tmp_path / f"{family}-test.gguf", model_dir)
    with pytest.raises(ModelNotFoundError, match="not converted yet"):
        resolve_model(str(gguf))
    folder = convert_gguf(gguf)
    assert folder == resolve_model(str(gguf)) == gguf_model_dir(str(gguf))
    assert served_model_name(str(gguf), folder) == f"{family}-test"
    runner = ModelRunner.from_config(WorkerConfig(model=str(gguf), num_kv_blocks=64, max_model_len=256,
                                                  device="cpu"), folder)
    got = serve(runner, 13)
    for handle, prompt in enumerate(prompts()):
        tokens, logprobs = got[handle]
        want_tokens, want_logprobs = oracle(model, prompt)
        assert tokens == want_tokens, f"{family} prompt {handle}"
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.parametrize("arch, named", [("falcon", "'falcon' is not a family steploop runs"),
                                         ("command-r", "transformers' GGUF reader cannot load it")])
def test_architectures_that_cannot_run_are_refused_before_dequantizing(arch, named, tmp_path, model_dir):
    import gguf as gguf_py
    path = tmp_path / f"{arch}.gguf"
    writer = gguf_py.GGUFWriter(str(path), arch)
    writer.add_name(arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=named):
        convert_gguf(path)
    assert not gguf_model_dir(str(path)).exists()
