"""The packed-weight cache (packed_weight_cache.py) on real worker starts of a small GGUF-exact checkpoint: a second
start reads the cache instead of packing and computes the same bits; a changed checkpoint, a truncated or corrupt
cache file, or a cache whose weights no longer match the checkpoint are packed again and rewritten, never used."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from steploop.gpu_worker import packed_weight_cache
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.cpu_kernels.packed_weights import unpack
from steploop.gpu_worker.model import packed_linear_layer
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.c_kernels import needs_c_kernels
from tests.worker.test_forward import run_flat
from tests.worker.test_packed_linear import gguf_q4_1, gguf_q8_0

pytestmark = needs_c_kernels()

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 128, 256, 4, 2, 32, 2, 96
CONFIG = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
          "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": True}


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A Llama checkpoint whose linear weights are exact Q4_1 values and whose (tied) embedding is Q8_0."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"model.embed_tokens.weight": gguf_q8_0(VOCAB, HIDDEN, seed), "model.norm.weight": torch.ones(HIDDEN)}
    shapes = {"self_attn.q_proj": (q, HIDDEN), "self_attn.k_proj": (kv, HIDDEN), "self_attn.v_proj": (kv, HIDDEN),
              "self_attn.o_proj": (HIDDEN, q), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for j, (name, (n, k)) in enumerate(shapes.items()):
            out[f"model.layers.{i}.{name}.weight"] = gguf_q4_1(n, k, seed * 100 + i * 10 + j)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.rand(HIDDEN)
    return out


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file(weights(1), folder / "model.safetensors")
    monkeypatch.setattr(packed_weight_cache, "cache_dir", lambda: tmp_path / "cache")
    return folder


@pytest.fixture
def pack_calls(monkeypatch):
    calls = []
    real = packed_linear_layer.pack
    monkeypatch.setattr(packed_linear_layer, "pack", lambda w: calls.append(1) or real(w))
    return calls


def start(folder, caplog) -> tuple[ModelRunner, str]:
    """A real worker start (ModelRunner.from_config) and its "packed weights: ..." log line."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        runner = ModelRunner.from_config(WorkerConfig(model=str(folder), num_kv_blocks=32, device="cpu"), folder)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("packed weights: ")
             and "linear weights" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    return runner, lines[0]


def cache_files(folder):
    return sorted((folder.parent / "cache" / "packed-weights").iterdir())


def logits(runner) -> torch.Tensor:
    return run_flat(runner.model, runner.kv_caches, runner.block_size, [(list(range(1, 30)), [1, 2], 0, 29)])


def test_second_start_reads_the_cache(checkpoint, pack_calls, caplog):
    first, line = start(checkpoint, caplog)
    assert "packed in" in line and "9 of 9 linear weights" in line and len(pack_calls) == 9
    assert [f.suffix for f in cache_files(checkpoint)] == [".safetensors"]          # no temp file left behind
    pack_calls.clear()
    second, line = start(checkpoint, caplog)
    assert line.startswith("packed weights: cached (") and pack_calls == []
    assert second.model.cpu_decoder is not None                                      # all layers packed: one C call
    assert torch.equal(logits(first), logits(second))


def test_changed_checkpoint_is_packed_again(checkpoint, pack_calls, caplog):
    start(checkpoint, caplog)
    old = cache_files(checkpoint)
    new = weights(2)
    save_file(new, checkpoint / "model.safetensors")
    pack_calls.clear()
    runner, line = start(checkpoint, caplog)
    assert "packed in" in line and len(pack_calls) == 9
    assert len(cache_files(checkpoint)) == 1 and cache_files(checkpoint) != old      # the stale file is replaced
    down = runner.model.model.layers[1].mlp.down_proj.packed
    assert torch.equal(unpack(down), new["model.layers.1.mlp.down_proj.weight"])


def test_weights_that_no_longer_match_are_never_used(checkpoint, pack_calls, caplog, monkeypatch):
    """A checkpoint rewritten in place with its old size and mtime, where the fingerprint's samples miss the change
    (none taken here): the key finds the old file, and the loaded weights' hashes refuse it."""
    monkeypatch.setattr(packed_weight_cache, "SAMPLES", 0)
    start(checkpoint, caplog)
    file = checkpoint / "model.safetensors"
    stat = file.stat()
    save_file(weights(3), file)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_size == stat.st_size
    pack_calls.clear()
    runner, line = start(checkpoint, caplog)
    assert "not used" in caplog.text and "is not the checkpoint's weight it was packed from" in caplog.text
    assert "packed in" in line and len(pack_calls) == 9
    assert torch.equal(unpack(runner.model.model.layers[0].self_attn.o_proj.packed),
                       weights(3)["model.layers.0.self_attn.o_proj.weight"])


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_cache_is_rebuilt(checkpoint, pack_calls, caplog, damage):
    first, _ = start(checkpoint, caplog)
    (file,) = cache_files(checkpoint)
    data = bytearray(file.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[-100] ^= 0x10                                 # inside the last tensor's bytes
    file.write_bytes(bytes(data))
    pack_calls.clear()
    second, line = start(checkpoint, caplog)
    assert "not used" in caplog.text and "packed in" in line and len(pack_calls) == 9
    assert torch.equal(logits(first), logits(second))
    pack_calls.clear()
    _, line = start(checkpoint, caplog)                    # rewritten whole: read from the cache again
    assert line.startswith("packed weights: cached (") and pack_calls == []
