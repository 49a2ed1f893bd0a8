"""The worker's LoRA hooks (lora/layers.py over lora/adapter_store.py) against the obvious per-token sum, on a
two-layer model of real nn.Linear projections: adapters of different ranks and targets mixed with base rows, a
fused qkv where one adapter lacks k (the step's run keeps k's zero rows) or has only k (the run is narrowed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from steploop.common.lora_adapter import LoraModelShapes
from steploop.gpu_worker.lora.adapter_store import AdapterStore, LoadedAdapter
from steploop.gpu_worker.lora.layers import PROJECTION_TARGETS, LoraLayers
from steploop.gpu_worker.lora.segments import build_lora_segments

HIDDEN, Q, KV, INTER, LAYERS, MAX_RANK = 32, 32, 8, 48, 2, 8
SHAPES = LoraModelShapes.for_llama(LAYERS, HIDDEN, Q, KV, INTER)
OFFSETS = {"qkv_proj": {"q_proj": 0, "k_proj": Q, "v_proj": Q + KV}, "o_proj": {"o_proj": 0},
           "gate_up_proj": {"gate_proj": 0, "up_proj": INTER}, "down_proj": {"down_proj": 0}}
ADAPTERS = {"qv_mlp": (8, 2.0, ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")),
            "k_only": (4, 0.5, ("k_proj",)), "attn": (8, 1.0, ("q_proj", "k_proj", "v_proj", "o_proj"))}


def tiny_model(gen: torch.Generator) -> SimpleNamespace:
    def linear(i, o):
        layer = nn.Linear(i, o, bias=False)
        layer.weight.data = torch.randn(o, i, generator=gen)
        return layer

    def layer():
        attn = SimpleNamespace(qkv_proj=linear(HIDDEN, Q + 2 * KV), o_proj=linear(Q, HIDDEN), q_size=Q, kv_size=KV)
        mlp = SimpleNamespace(gate_up_proj=linear(HIDDEN, 2 * INTER), down_proj=linear(INTER, HIDDEN),
                              intermediate_size=INTER)
        return SimpleNamespace(self_attn=attn, mlp=mlp)
    return SimpleNamespace(model=SimpleNamespace(layers=[layer() for _ in range(LAYERS)]))


def adapter(name: str, gen: torch.Generator) -> LoadedAdapter:
    rank, scaling, targets = ADAPTERS[name]
    weights = {t: (torch.randn(LAYERS, rank, SHAPES.targets[t][0], generator=gen),
                   torch.randn(LAYERS, SHAPES.targets[t][1], rank, generator=gen)) for t in targets}
    return LoadedAdapter(name, f"/adapters/{name}", scaling, weights, rank)


def per_token(x, y, token_names, adapters, projection, layer):
    out = y.clone()
    for row, name in enumerate(token_names):
        if name is None:
            continue
        for target, offset in OFFSETS[projection].items():
            if target in adapters[name].weights:
                a, b = adapters[name].weights[target]
                delta = adapters[name].scaling * (x[row] @ a[layer].t()) @ b[layer].t()
                out[row, offset:offset + b.shape[1]] += delta
    return out


@pytest.mark.parametrize("names", [("qv_mlp", "k_only"), ("qv_mlp",), ("k_only",), ("attn", "qv_mlp", "k_only")])
@pytest.mark.parametrize("max_stack_rank", [None, 8], ids=["one-stack", "split-stacks"])
def test_every_projection_adds_each_rows_adapter(names, max_stack_rank):
    gen = torch.Generator().manual_seed(len(names))
    model = tiny_model(gen)
    store = AdapterStore(SHAPES, 3, 3, MAX_RANK, torch.float32, torch.device("cpu"), PROJECTION_TARGETS.values(),
                         max_stack_rank)
    layers, adapters = LoraLayers(model, store), {n: adapter(n, gen) for n in names}
    for name, loaded in adapters.items():
        store.register(name, loaded.path)
        store.loaded[name] = loaded                     # as if read from its folder
    slots = store.activate(set(names))
    token_names = [names[0], None, names[-1], names[0], None, names[-1], names[-1]]
    token_slots = torch.tensor([slots[n] if n else -1 for n in token_names], dtype=torch.int32)
    layers.begin(build_lora_segments(token_slots), sorted(slots.values()))
    for index, layer in enumerate(model.model.layers):
        for projection, linear in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                                   ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            x = torch.randn(len(token_names), linear.in_features, generator=gen)
            want = per_token(x, x @ linear.weight.t(), token_names, adapters, projection, index)
            torch.testing.assert_close(linear(x), want, rtol=1e-4, atol=1e-4)
    layers.end()
    x = torch.randn(3, HIDDEN, generator=gen)
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj(x), x @ model.model.layers[0].self_attn
                               .qkv_proj.weight.t(), rtol=0, atol=0)     # no step armed: the base linear alone
