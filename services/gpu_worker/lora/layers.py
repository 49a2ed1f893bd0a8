"""The layer wrapper: LoRA added to the base projections' outputs, as forward hooks on the model's own linears.

The base linears stay what the KernelPlan built (packed C matmuls, torch, Triton), untouched, so a step without
adapter requests is exactly the base path (and may still run every layer in one C call: LlamaForCausalLM checks
`active`). In a step with adapters each hooked projection adds, for the rows in the step's LoraSegments,
scale * x @ A^T @ B^T of the row's adapter. The fused projections take one sub-target each at its column offset:

    qkv_proj      q_proj @ 0, k_proj @ q_size, v_proj @ q_size + kv_size
    o_proj        o_proj @ 0
    gate_up_proj  gate_proj @ 0, up_proj @ intermediate_size
    down_proj     down_proj @ 0

The sub-targets' A are stacked (adapter_store.StackedA), so a fused projection is one lora_shrink and one
lora_expand_slices (services/gpu_worker/kernels/lora_ops.py: Triton on CUDA, addmm per segment on the CPU), not
one pair per sub-target. A step uses of each stack the targets from the first to the last one its adapters have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from steploop.gpu_worker.kernels.lora_ops import lora_expand_slices, lora_shrink
from steploop.gpu_worker.lora.adapter_store import AdapterStore, StackedA
from steploop.gpu_worker.lora.segments import LoraSegments

# the model's linears -> the PEFT targets they compute, in column order (the stacking groups of the store)
PROJECTION_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                      "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class _StackRun:
    """What one stack adds in this step: its A narrowed to the step's targets (those in between that no adapter
    of the step has stay in: zero A and B add exact zeros), their B and column offsets."""

    a: torch.Tensor                      # [layers, L, r, in]
    bs: tuple[torch.Tensor, ...]         # per target: [layers, L, out, R]
    offsets: tuple[int, ...]


class LoraLayers:
    def __init__(self, model: nn.Module, store: AdapterStore) -> None:
        self.store = store
        self.segments: LoraSegments | None = None
        self.runs: dict[int, _StackRun] = {}                 # id(stack) -> this step's run of it
        self.offsets: dict[str, int] = {}                    # target -> its first column in its projection
        for index, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not hasattr(mlp, "gate_up_proj"):
                raise ValueError(f"--enable-lora: layer {index} has a mixture-of-experts MLP; LoRA is served on "
                                 "dense Llama-family models only")
            q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
            offsets = {"q_proj": 0, "k_proj": q, "v_proj": q + kv, "o_proj": 0, "gate_proj": 0, "up_proj": inter,
                       "down_proj": 0}
            if self.offsets not in ({}, offsets):
                raise ValueError(f"--enable-lora: layer {index} has other projection sizes than layer 0")
            self.offsets = offsets
            for name, linear in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                                 ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)):
                targets = set(PROJECTION_TARGETS[name])
                self._hook(linear, index, [s for s in store.stacks if targets.issuperset(s.targets)])

    @property
    def active(self) -> bool:
        return self.segments is not None

    def begin(self, segments: LoraSegments, slots: list[int]) -> None:
        """This step's segments and the slots they use (hooks add LoRA until end())."""
        present = {t for t, table in self.store.tables.items() if any(table.has[s] for s in slots)}
        # the Triton shrink reads a contiguous A, so on CUDA a stack runs whole
        whole = self.store.device.type == "cuda"
        self.runs = {id(stack): run for stack in self.store.stacks
                     if (run := self._run(stack, present, whole)) is not None}
        self.segments = segments

    def begin_all(self, segments: LoraSegments) -> None:
        """Arm every stack whole over static segments (a CUDA graph's capture: whatever adapters a replayed step
        has, their targets are in; a target no adapter of the step has adds exact zeros)."""
        every = set(self.store.tables)
        self.runs = {id(stack): run for stack in self.store.stacks
                     if (run := self._run(stack, every, True)) is not None}
        self.segments = segments

    def end(self) -> None:
        self.segments, self.runs = None, {}

    def _run(self, stack: StackedA, present: set[str], whole: bool) -> _StackRun | None:
        used = [i for i, t in enumerate(stack.targets) if t in present]
        if not used:
            return None
        first, last = (0, len(stack.targets) - 1) if whole else (used[0], used[-1])
        rank, targets = self.store.max_rank, stack.targets[first:last + 1]
        return _StackRun(stack.a[:, :, first * rank:(last + 1) * rank],
                         tuple(self.store.tables[t].b for t in targets), tuple(self.offsets[t] for t in targets))

    def _hook(self, linear: nn.Module, layer: int, stacks: list[StackedA]) -> None:
        keys, scale = [id(s) for s in stacks], self.store.scale

        def add_lora(module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor | None:
            seg = self.segments
            if seg is None:
                return None
            for key in keys:
                run = self.runs.get(key)
                if run is not None:
                    z = lora_shrink(args[0], run.a[layer], seg, scale)
                    lora_expand_slices(y, z, [b[layer] for b in run.bs], seg, run.offsets)
            return y

        linear.register_forward_hook(add_lora)
