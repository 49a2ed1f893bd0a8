"""The KV sizing arithmetic (memory_profile.py): every reserve comes off, the peaks do not stack, budgets above 8192
are profiled whole; and the profile's forward over several prompts is a real forward."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker import memory_profile as mp

GIB = 2 ** 30


def test_every_reserve_comes_off_the_budget():
    p = mp.MemoryProfile(total=140 * GIB, utilization=0.95, in_use=17 * GIB, forward_peak=3 * GIB,
                         sampler_peak=5 * GIB, graph_pool=1 * GIB, lora_slots=2 * GIB, nccl=GIB // 2)
    assert p.step_peak == 5 * GIB                   # the sampler's peak wins; the forward's is freed before it
    assert p.kv_bytes == int(140 * GIB * 0.95) - 17 * GIB - 5 * GIB - 1 * GIB - 2 * GIB - GIB // 2
    assert "KV cache 107.50 GiB" in p.describe() and "NCCL 0.50 GiB" in p.describe()


def test_graph_pool_scales_with_the_largest_graph():
    # 4 GiB of activations for an 8192-token forward: the 2048-token graph holds a quarter, plus split partials
    split = mp.split_partials_bytes(tokens=256, num_heads=32, head_dim=128, num_splits=16)
    assert split == 256 * 32 * 16 * 130 * 4
    pool = mp.graph_pool_bytes(4 * GIB, 8192, 2048, num_graphs=16, decode_split_bytes=split)
    assert pool == GIB + split + 16 * mp.GRAPH_OVERHEAD
    assert mp.graph_pool_bytes(4 * GIB, 8192, 2048, 0, split) == 0
    assert mp.split_partials_bytes(256, 32, 128, 1) == 0


def test_lora_slots_match_the_adapter_store():
    from steploop.common.lora_adapter import LoraModelShapes
    from steploop.gpu_worker.lora.adapter_store import AdapterStore

    shapes = LoraModelShapes.for_llama(num_layers=2, hidden=32, q_size=32, kv_size=16, intermediate=48)
    store = AdapterStore(shapes, max_loras=3, max_cpu_loras=3, max_rank=8, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    held = sum(s.a.numel() * s.a.element_size() for s in store.stacks) \
        + sum(t.b.numel() * t.b.element_size() for t in store.tables.values()) + store.scale.numel() * 4
    assert mp.lora_slot_bytes(2, shapes.targets, 3, 8, 2) == held


@pytest.mark.parametrize("world,env,want", [
    (1, {}, 0),
    (2, {}, 2 * 1 * 32 * (4 << 20)),                               # one neighbour
    (8, {}, 2 * 2 * 32 * (4 << 20)),                               # a ring: two
    (8, {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "8"}, 2 * 2 * 8 * (1 << 20)),
])
def test_nccl_buffers(world, env, want):
    assert mp.nccl_bytes(world, env) == want


@pytest.mark.parametrize("budget,max_len,want", [(8192, 8192, [8192]), (16384, 4096, [4096] * 4),
                                                 (20000, 8192, [8192, 8192, 3616]), (512, 2048, [512])])
def test_the_profile_runs_the_whole_budget(budget, max_len, want):
    assert mp.profile_sequences(budget, max_len) == want


def test_profile_forward_over_several_prompts(fresh_runner, hf_model):
    """A budget of 2.5 prompts' worth: three prompts of token 0 in one forward, each last position's logits equal to
    transformers' for that prompt length."""
    from steploop.gpu_worker.model_runner import _profile_forward, _profile_sampler

    model = fresh_runner.model
    logits = _profile_forward(model, model.config, 16, 24, torch.float32, torch.device("cpu"), budget=60)
    assert logits.shape == (3, model.config.vocab_size)
    with torch.no_grad():
        for row, n in enumerate((24, 24, 12)):
            want = hf_model(torch.zeros(1, n, dtype=torch.long)).logits[0, -1]
            torch.testing.assert_close(logits[row], want, atol=2e-3, rtol=1e-3)
    assert _profile_sampler(model, 8, torch.device("cpu")).shape == (8,)
