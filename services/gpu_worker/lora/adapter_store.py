"""Adapters in the worker: an LRU of loaded adapters in host memory and the stacked slot table on the device.

    store = AdapterStore(shapes, max_loras, max_cpu_loras, max_rank, dtype, device)
    store.register(name, path)        # from the plan (names and paths, never weights); loads lazily
    slots = store.activate(names)     # this step's adapters (<= max_loras) -> their slots, loading as needed
    store.tables[target]              # SlotTable: a [L, R, in], b [L, out, R], scale [L], has [L]

An adapter of rank r < R fills the first r rows of A and columns of B; the rest stay zero, so every slot is a
rank-R product. A slot whose adapter does not target a projection has zeros there and `has` False, which the
torch path uses to skip it. Loading validates the folder again (services/common/lora_adapter.py) before reading.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.common.lora_adapter import LoraAdapterError, LoraModelShapes, read_adapter

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
    """One projection's stacked adapters, per layer: what the LoRA ops read."""

    a: torch.Tensor                      # [layers, L, R, in]
    b: torch.Tensor                      # [layers, L, out, R]
    scale: torch.Tensor                  # [L] float32, 0 for an empty slot
    has: list[bool]                      # [L] the slot's adapter targets this projection


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
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shapes, self.max_loras, self.max_cpu_loras, self.max_rank = shapes, max_loras, max_cpu_loras, max_rank
        self.paths: dict[str, str] = {}                         # registered: name -> folder
        self.loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()   # host LRU, most recent last
        self.slot_of: OrderedDict[str, int] = OrderedDict()    # name -> slot, most recently used last
        self.tables = {t: SlotTable(torch.zeros(shapes.num_layers, max_loras, max_rank, i, dtype=dtype, device=device),
                                    torch.zeros(shapes.num_layers, max_loras, o, max_rank, dtype=dtype, device=device),
                                    torch.zeros(max_loras, dtype=torch.float32, device=device), [False] * max_loras)
                       for t, (i, o) in shapes.targets.items()}

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
                table.scale[slot] = adapter.scaling
                table.has[slot] = True

    def _clear_slot(self, slot: int) -> None:
        for table in self.tables.values():
            table.a[:, slot].zero_()
            table.b[:, slot].zero_()
            table.scale[slot] = 0.0
            table.has[slot] = False

