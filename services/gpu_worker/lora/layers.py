"""The layer wrapper: LoRA added to the base projections' outputs, as forward hooks on the model's own linears.

The base linears stay what the KernelPlan built (packed C matmuls, torch, Triton), untouched, so a step without
adapter requests is exactly the base path (and may still run every layer in one C call: LlamaForCausalLM checks
`active`). In a step with adapters each hooked projection adds, for the rows in the step's LoraSegments,
scale * x @ A^T @ B^T of the row's adapter. The fused projections take one sub-target each at its column offset:

    qkv_proj      q_proj @ 0, k_proj @ q_size, v_proj @ q_size + kv_size
    o_proj        o_proj @ 0
    gate_up_proj  gate_proj @ 0, up_proj @ intermediate_size
    down_proj     down_proj @ 0
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from services.gpu_worker.lora.adapter_store import AdapterStore
from services.gpu_worker.lora.segments import LoraSegments


class LoraLayers:
    def __init__(self, model: nn.Module, store: AdapterStore, ops: ModuleType) -> None:
        self.store, self.ops = store, ops
        self.segments: LoraSegments | None = None
        self.targets_in_step: set[str] = set()               # targets some adapter of this step has
        for index, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not hasattr(mlp, "gate_up_proj"):
                raise ValueError(f"--enable-lora: layer {index} has a mixture-of-experts MLP; LoRA is served on "
                                 "dense Llama-family models only")
            q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
            self._hook(attn.qkv_proj, index, (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)))
            self._hook(attn.o_proj, index, (("o_proj", 0),))
            self._hook(mlp.gate_up_proj, index, (("gate_proj", 0), ("up_proj", inter)))
            self._hook(mlp.down_proj, index, (("down_proj", 0),))

    @property
    def active(self) -> bool:
        return self.segments is not None

    def begin(self, segments: LoraSegments, slots: list[int]) -> None:
        """This step's segments and the slots they use (hooks add LoRA until end())."""
        self.segments = segments
        self.targets_in_step = {t for t, table in self.store.tables.items() if any(table.has[s] for s in slots)}

    def end(self) -> None:
        self.segments, self.targets_in_step = None, set()

    def _hook(self, linear: nn.Module, layer: int, subs: tuple[tuple[str, int], ...]) -> None:
        tables = self.store.tables

        def add_lora(module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor | None:
            seg = self.segments
            if seg is None:
                return None
            for target, offset in subs:
                if target in self.targets_in_step:
                    table = tables[target]
                    z = self.ops.shrink(args[0], table.a[layer], seg, table.scale)
                    self.ops.expand(y, z, table.b[layer], seg, offset)
            return y

        linear.register_forward_hook(add_lora)
