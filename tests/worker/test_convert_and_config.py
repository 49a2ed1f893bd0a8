"""The converted default model's tokenizer, WorkerConfig/flags, and KV cache sizing."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from steploop.common.lora_config import LoraConfig
from steploop.gpu_worker import kv_cache
from steploop.gpu_worker.config import WorkerConfig, add_cli_args
from steploop.gpu_worker.model.model_config import LlamaModelConfig


def test_converted_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert tok.bos_token_id == 1
    assert tok("hi").input_ids[0] != tok.bos_token_id and tok.decode(tok("Hello world").input_ids) == "Hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    cfg = LlamaModelConfig.from_dir(model_dir)
    assert cfg.eos_token_ids == (2,) and cfg.tie_word_embeddings and cfg.num_key_value_heads == 3
    assert not (model_dir / "tokenizer.model").exists()          # the GGUF is not copied along


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("STEPLOOP_BLOCK_SIZE", "32")
    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--num-kv-blocks", "100", "--max-model-len", "512"])
    config = WorkerConfig.from_args(args)
    assert (config.block_size, config.num_kv_blocks, config.max_model_len) == (32, 100, 512)
    assert config.scheduler_address == "127.0.0.1:50051" and config.model is None
    assert config.resolved_dtype("cpu") == torch.float32 and config.resolved_dtype("cuda") == torch.bfloat16


@pytest.mark.parametrize("kwargs, text", [({"block_size": 12}, "--block-size"), ({"num_kv_blocks": 1}, "null"),
                                          ({"attention_backend": "x"}, "--attention-backend"),
                                          ({"kv_cache_memory_fraction": 2.0}, "fraction"),
                                          ({"tensor_parallel_size": 3, "lora": LoraConfig(enable_lora=True)},
                                           "--enable-lora with -tp 3"),
                                          ({"tensor_parallel_size": 3, "runner": "pooling"}, "pooling runner")])
def test_config_errors(kwargs, text):
    with pytest.raises(ValueError, match=text):
        WorkerConfig(**kwargs)


def test_kv_sizing(model_dir):
    cfg = LlamaModelConfig.from_dir(model_dir)
    per_block = kv_cache.bytes_per_block(cfg, 16, torch.float32)
    assert per_block == 2 * 16 * 3 * 64 * 4 * 30
    cpu = torch.device("cpu")
    assert kv_cache.decide_num_blocks(WorkerConfig(num_kv_blocks=65), cfg, 1024, torch.float32, cpu, None) == 65
    with pytest.raises(ValueError, match="--num-kv-blocks"):
        kv_cache.decide_num_blocks(WorkerConfig(num_kv_blocks=64), cfg, 1024, torch.float32, cpu, None)
    measured = kv_cache.decide_num_blocks(WorkerConfig(kv_cache_memory_fraction=0.01), cfg, 64, torch.float32,
                                          cpu, None)
    assert measured >= 5
    caches = kv_cache.allocate_kv_caches(cfg, 3, 16, torch.float32, cpu)
    assert len(caches) == 30 and caches[0].shape == (2, 3, 16, 3, 64)
