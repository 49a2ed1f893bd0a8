"""The loader holds only the target dtype: a bf16 checkpoint in shards loads at its own size plus about one shard
(the mmapped file being read), no fp32 copy of the model is ever allocated (on a GPU the old fp32-then-cast made an
8B model peak at 32 GB; on the CPU untouched fp32 pages never become resident, so that part is checked by
watching allocations), and every weight arrives exactly."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Measured in a fresh process, on a second load (the first pays one-time imports and caches): VmHWM reset with
# clear_refs 5, then the load's peak resident set over the resident set before it.
PEAK_SCRIPT = """
import gc, json, pathlib, sys, torch
from steploop.gpu_worker.attention.selector import create_backend
from steploop.gpu_worker.model.loader import load_model
from steploop.gpu_worker.model.model_config import ModelConfig

def status(key):
    line = next(l for l in open('/proc/self/status') if l.startswith(key + ':'))
    return int(line.split()[1]) * 1024

path, dtype = pathlib.Path(sys.argv[1]), getattr(torch, sys.argv[2])
cfg = ModelConfig.from_dir(path)
backend = create_backend('torch', cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.scale)
load_model(path, backend, 64, dtype, torch.device('cpu'))   # dropped at once
gc.collect()
open('/proc/self/clear_refs', 'w').write('5')
before = status('VmRSS')
model = load_model(path, backend, 64, dtype, torch.device('cpu'))
print(json.dumps({'peak_delta': status('VmHWM') - before,
                  'model_bytes': sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> pathlib.Path:
    import transformers
    out = tmp_path_factory.mktemp("bf16-shards")
    config = transformers.LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, max_shard_size="20MB")
    return out


def _shards(path: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path.glob("*.safetensors"))


def test_bf16_peak_is_checkpoint_plus_one_shard(bf16_checkpoint):
    shards = _shards(bf16_checkpoint)
    assert len(shards) >= 3
    size, largest = sum(s.stat().st_size for s in shards), max(s.stat().st_size for s in shards)
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(bf16_checkpoint), "bfloat16"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["model_bytes"] == pytest.approx(size, rel=0.01)       # the model is held in bf16 only
    # size + one shard, plus 10% for the allocator and the rotary tables; fp32-then-cast would be ~3x size
    assert got["peak_delta"] <= 1.1 * (size + largest), (got, size, largest)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weights_arrive_exactly(bf16_checkpoint, dtype):
    from safetensors.torch import load_file

    from steploop.gpu_worker.attention.selector import create_backend
    from steploop.gpu_worker.model.loader import load_model
    from steploop.gpu_worker.model.model_config import ModelConfig

    cfg = ModelConfig.from_dir(bf16_checkpoint)
    backend = create_backend("torch", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.scale)
    model = load_model(bf16_checkpoint, backend, 64, dtype, torch.device("cpu"))
    params = dict(model.named_parameters())
    assert all(p.dtype == dtype for p in params.values())
    stored = {k: v for s in _shards(bf16_checkpoint) for k, v in load_file(s).items()}
    q = cfg.num_attention_heads * cfg.head_dim
    assert torch.equal(params["model.layers.1.self_attn.qkv_proj.weight"][:q],
                       stored["model.layers.1.self_attn.q_proj.weight"].to(dtype))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.norm.weight"):
        assert torch.equal(params[name], stored[name].to(dtype)), name


def test_no_tensor_of_another_float_dtype_is_allocated(bf16_checkpoint):
    """Every sizeable float tensor the load allocates is bf16 (the old path allocated the model in fp32 first)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from steploop.gpu_worker.attention.selector import create_backend
    from steploop.gpu_worker.model.loader import load_model
    from steploop.gpu_worker.model.model_config import ModelConfig

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, torch.dtype, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                    self.seen.append((str(func), t.dtype, t.numel()))
            return out

    cfg = ModelConfig.from_dir(bf16_checkpoint)
    backend = create_backend("torch", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.scale)
    with Allocations() as allocations:
        load_model(bf16_checkpoint, backend, 64, torch.bfloat16, torch.device("cpu"))
    sizeable = [(f, d, n) for f, d, n in allocations.seen if n >= 1 << 16]
    assert sizeable and all(d == torch.bfloat16 for _, d, _ in sizeable), [s for s in sizeable if s[1] != torch.bfloat16][:5]
