"""LoraManager: the worker's side of multi-LoRA serving, one object the ModelRunner talks to.

    manager = LoraManager.build(model, lora_config, dtype, device)   # only with --enable-lora
    manager.apply_plan(plan)          # adapters to register/drop, each new request's adapter, dropped handles
    if manager.begin_step(plan):      # some scheduled request uses an adapter: segments built, hooks armed
        ... forward layer by layer ...
    manager.end_step()

Each token's slot comes from its request's adapter (-1 = base), in the flat batch's order (scheduled_handles,
num_scheduled_tokens each); the segments (lora/segments.py) are built once per step and read by every layer.
"""

from __future__ import annotations

import numpy as np
import torch

from steploop.common.lora_adapter import LoraModelShapes
from steploop.common.lora_config import LoraConfig
from steploop.common.step_contract import StepPlan
from steploop.gpu_worker.kernels.lora_meta import MAX_KERNEL_RANK
from steploop.gpu_worker.lora.adapter_store import AdapterStore
from steploop.gpu_worker.lora.layers import PROJECTION_TARGETS, LoraLayers
from steploop.gpu_worker.lora.segments import build_lora_segments


def model_shapes(cfg) -> LoraModelShapes:
    """What an adapter must fit in this model (sent to the scheduler in the hello, which checks adapters)."""
    return LoraModelShapes.for_llama(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                                     cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)


class LoraManager:
    def __init__(self, store: AdapterStore, layers: LoraLayers, device: torch.device) -> None:
        self.store, self.layers, self.device = store, layers, device
        self.adapter_of: dict[int, str] = {}                 # handle -> adapter name (base requests absent)

    @classmethod
    def build(cls, model, config: LoraConfig, dtype: torch.dtype, device: torch.device) -> LoraManager:
        # the Triton kernels cover a stack of at most MAX_KERNEL_RANK ranks; the CPU path any
        max_stack_rank = MAX_KERNEL_RANK if device.type == "cuda" else None
        store = AdapterStore(model_shapes(model.config), config.max_loras, config.cpu_loras, config.max_lora_rank,
                             dtype, device, PROJECTION_TARGETS.values(), max_stack_rank)
        return cls(store, LoraLayers(model, store), device)

    def apply_plan(self, plan: StepPlan) -> None:
        for name in plan.lora_drops:
            self.store.drop(name)
        for ref in plan.lora_loads:
            self.store.register(ref.name, ref.path)
        for handle in plan.finished_handles:
            self.adapter_of.pop(handle, None)
        for handle in plan.preempted_handles:
            self.adapter_of.pop(handle, None)
        for new in plan.new_requests:
            if new.lora_name:
                self.adapter_of[new.handle] = new.lora_name
            else:
                self.adapter_of.pop(new.handle, None)

    def reset(self) -> None:
        self.adapter_of.clear()

    def begin_step(self, plan: StepPlan) -> bool:
        """Arm the hooks for a step with adapter requests; False (and the base path) when it has none."""
        adapter_of = self.adapter_of
        if not adapter_of:
            return False
        names = [adapter_of.get(h) for h in plan.scheduled_handles]
        used = {n for n in names if n is not None}
        if not used:
            return False
        slots = self.store.activate(used)
        per_request = np.fromiter((slots[n] if n is not None else -1 for n in names), np.int32, len(names))
        token_slots = np.repeat(per_request, plan.num_scheduled_tokens)
        segments = build_lora_segments(torch.from_numpy(token_slots))
        if segments is None:
            return False
        self.layers.begin(segments.to(self.device), sorted(set(slots.values())))
        return True

    def end_step(self) -> None:
        self.layers.end()
