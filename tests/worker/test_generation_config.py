"""--generation-config as vLLM's: auto reads the model folder's generation_config.json (the sampling fields that
differ from transformers' defaults, max_new_tokens as max_tokens), vllm ignores it, a folder is read instead; the
worker says the result (and the EOS ids) in WorkerHello."""

from __future__ import annotations

import json
import logging

import pytest

from steploop.common.generation_defaults import GenerationDefaults
from steploop.common.step_contract import WorkerInfo
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.generation_config import generation_eos_ids, read_generation_defaults
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.family_models import build_family_model

RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1, "max_new_tokens": 7, "eos_token_id": [2, 5]}
EXPECTED = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=7)


def folder_with(tmp_path, name: str, generation: dict):
    path = tmp_path / name
    path.mkdir()
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_auto_takes_the_recommended_fields_and_says_so(tmp_path, caplog):
    path = folder_with(tmp_path, "model", RECOMMENDED)
    with caplog.at_level(logging.WARNING):
        assert read_generation_defaults("auto", path) == EXPECTED
    assert "Default sampling parameters have been overridden by the model's Hugging Face generation config" \
        in caplog.text


def test_transformers_own_defaults_are_not_taken(tmp_path, caplog):
    """As vLLM (to_diff_dict): temperature 1.0 and top_k 50 are GenerationConfig()'s, so no override, no log."""
    path = folder_with(tmp_path, "model", {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "eos_token_id": 2})
    with caplog.at_level(logging.WARNING):
        assert read_generation_defaults("auto", path) == GenerationDefaults()
    assert "overridden" not in caplog.text


def test_vllm_ignores_the_file_and_a_folder_replaces_it(tmp_path):
    model = folder_with(tmp_path, "model", RECOMMENDED)
    other = folder_with(tmp_path, "other", {"temperature": 0.2, "eos_token_id": 9})
    assert read_generation_defaults("vllm", model) == GenerationDefaults()
    assert read_generation_defaults(str(other), model) == GenerationDefaults(temperature=0.2)
    assert generation_eos_ids(str(other), model, (2, 5)) == (9,)
    assert generation_eos_ids("vllm", model, (2, 5)) == (2, 5)


def test_a_folder_without_a_generation_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--generation-config .* folder holding a generation_config.json"):
        read_generation_defaults(str(tmp_path), tmp_path)


@pytest.mark.parametrize("mode, expected", [("auto", EXPECTED), ("vllm", GenerationDefaults())])
def test_the_worker_says_them_in_its_hello(tmp_path, model_dir, mode, expected):
    path = build_family_model("qwen3", tmp_path / "qwen3", model_dir)
    (path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    config = WorkerConfig(model=str(path), num_kv_blocks=16, max_model_len=64, device="cpu", generation_config=mode)
    info = ModelRunner.from_config(config, path).info
    assert info.generation_defaults == expected and info.eos_token_ids == (2, 5)
    assert WorkerInfo.from_pb(info.to_pb()) == info
