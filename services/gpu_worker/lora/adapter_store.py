"""Adapters in the worker: an LRU of loaded adapters in host memory and the stacked slot table on the device.

    store = AdapterStore(shapes, max_loras, max_cpu_loras, max_rank, dtype, device, stack_groups, max_stack_rank)
    store.register(name, path)        # from the plan (names and paths, never weights); loads lazily
    slots = store.activate(names)     # this step's adapters (<= max_loras) -> their slots, loading as needed
    store.tables[target]              # SlotTable: a [layers, L, R, in], b [layers, L, out, R], has [L]
    store.stacks                      # StackedA: the A of targets sharing one input, [layers, L, k * R, in]
    store.scale                       # [L] fp32: each slot's adapter scaling, 0 for an empty slot

The targets of one fused projection (q/k/v, gate/up: `stack_groups`) share their input, so their A live stacked
on the rank axis (a target's table.a is a view into its stack) and one shrink serves them all; on CUDA a stack
holds at most `max_stack_rank` ranks (what the Triton kernels cover), so a group may split into several stacks.
An adapter of rank r < R fills the first r rows of A and columns of B; the rest stay zero, so every slot is a
rank-R product. A slot whose adapter does not target a projection has zeros there (its products are exact zeros)
and `has` False. Loading validates the folder again (services/common/lora_adapter.py) before reading.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from steploop.common.lora_adapter import LoraAdapterError, LoraModelShapes, read_adapter

log = logging.getLogger(__name__)


@dataclass
class LoadedAdapter:
    name: str
    path: str
    scaling: float
    # target -> (A [layers, r, in], B [layers, out, r]) in host memory; layers without weights are zero
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int


@dataclass
class SlotTable:
    """One target's adapters, per layer and slot: what the LoRA ops read."""

    a: torch.Tensor                      # [layers, L, R, in] a view into its StackedA
    b: torch.Tensor                      # [layers, L, out, R]
    has: list[bool]                      # [L] the slot's adapter targets this projection


@dataclass
class StackedA:
    """The A of targets that read the same input, stacked on the rank axis: one shrink computes all of them."""

    targets: tuple[str, ...]
    a: torch.Tensor                      # [layers, L, len(targets) * R, in], target i at rows [i * R, (i + 1) * R)


def load_adapter(name: str, path: str, shapes: LoraModelShapes, max_rank: int) -> LoadedAdapter:
    from safetensors import safe_open
    spec = read_adapter(path, shapes, max_rank)
    weights = {}
    with safe_open(f"{spec.path}/adapter_model.safetensors", framework="pt") as f:
        for target in spec.targets:
            in_features, out_features = shapes.targets[target]
            a = torch.zeros(shapes.num_layers, spec.rank, in_features)
            b = torch.zeros(shapes.num_layers, out_features, spec.rank)
            for layer in range(shapes.num_layers):
                if (layer, target, "A") in spec.tensor_names:
                    a[layer] = f.get_tensor(spec.tensor_names[(layer, target, "A")]).float()
                    b[layer] = f.get_tensor(spec.tensor_names[(layer, target, "B")]).float()
            weights[target] = (a, b)
    return LoadedAdapter(name, spec.path, spec.scaling, weights, spec.rank)


class AdapterStore:
    def __init__(self, shapes: LoraModelShapes, max_loras: int, max_cpu_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, stack_groups: Iterable[tuple[str, ...]] = (),
                 max_stack_rank: int | None = None) -> None:
        self.shapes, self.max_loras, self.max_cpu_loras, self.max_rank = shapes, max_loras, max_cpu_loras, max_rank
        self.device = device
        self.paths: dict[str, str] = {}                         # registered: name -> folder
        self.loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()   # host LRU, most recent last
        self.slot_of: OrderedDict[str, int] = OrderedDict()    # name -> slot, most recently used last
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.stacks: list[StackedA] = []
        self.tables: dict[str, SlotTable] = {}
        for targets in _stacks(shapes, stack_groups, max_rank, max_stack_rank):
            in_features = shapes.targets[targets[0]][0]
            a = torch.zeros(shapes.num_layers, max_loras, len(targets) * max_rank, in_features, dtype=dtype,
                            device=device)
            self.stacks.append(StackedA(targets, a))
            for i, target in enumerate(targets):
                out_features = shapes.targets[target][1]
                b = torch.zeros(shapes.num_layers, max_loras, out_features, max_rank, dtype=dtype, device=device)
                self.tables[target] = SlotTable(a[:, :, i * max_rank:(i + 1) * max_rank], b, [False] * max_loras)

    def register(self, name: str, path: str) -> None:
        if self.paths.get(name) not in (None, path):
            self.drop(name)              # the same name, another folder: the old weights go
        self.paths[name] = path

    def drop(self, name: str) -> None:
        self.paths.pop(name, None)
        self.loaded.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self._clear_slot(slot)

    def activate(self, names: set[str]) -> dict[str, int]:
        """Slots for this step's adapters: those already in a slot stay; others take the least recently used slot
        that this step does not need."""
        if len(names) > self.max_loras:
            raise ValueError(f"a step uses {len(names)} adapters but --max-loras is {self.max_loras}")
        for name in names:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            free = set(range(self.max_loras)) - set(self.slot_of.values())
            if free:
                slot = min(free)
            else:
                victim = next(n for n in self.slot_of if n not in names)
                slot = self.slot_of.pop(victim)
            self._fill_slot(slot, self._host_copy(name))
            self.slot_of[name] = slot
        return {name: self.slot_of[name] for name in names}

    def _host_copy(self, name: str) -> LoadedAdapter:
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return self.loaded[name]
        if name not in self.paths:
            raise LoraAdapterError(f"LoRA adapter {name!r} was never registered with this worker", not_found=True)
        adapter = load_adapter(name, self.paths[name], self.shapes, self.max_rank)
        log.info("loaded LoRA adapter %s from %s (rank %d, %s)", name, adapter.path, adapter.rank,
                 ", ".join(adapter.weights))
        self.loaded[name] = adapter
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        return adapter

    def _fill_slot(self, slot: int, adapter: LoadedAdapter) -> None:
        self._clear_slot(slot)
        r = adapter.rank
        for target, table in self.tables.items():
            if target in adapter.weights:
                a, b = adapter.weights[target]
                table.a[:, slot, :r].copy_(a)
                table.b[:, slot, :, :r].copy_(b)
                table.has[slot] = True
        self.scale[slot] = adapter.scaling

    def _clear_slot(self, slot: int) -> None:
        for table in self.tables.values():
            table.a[:, slot].zero_()
            table.b[:, slot].zero_()
            table.has[slot] = False
        self.scale[slot] = 0.0


def _stacks(shapes: LoraModelShapes, groups: Iterable[tuple[str, ...]], max_rank: int,
            max_stack_rank: int | None) -> list[tuple[str, ...]]:
    """The targets of each group (sharing one input) in stacks of at most max_stack_rank ranks; every target not
    in a group stacks alone."""
    per_stack = max(1, max_stack_rank // max_rank) if max_stack_rank else len(shapes.targets)
    stacks, grouped = [], set()
    for group in groups:
        if len({shapes.targets[t][0] for t in group}) != 1:
            raise ValueError(f"targets {group} do not share one input size; they cannot be stacked")
        stacks += [tuple(group[i:i + per_stack]) for i in range(0, len(group), per_stack)]
        grouped.update(group)
    return stacks + [(t,) for t in shapes.targets if t not in grouped]

