"""PackedLinear: the linear layer of a KernelPlan with packed_linears (the CPU in fp32). It is built and loaded as an
nn.Linear; after loading, each one whose weight is exactly GGUF-quantized values takes that weight's packed form
(cpu_kernels/packed_linear.c): the same fp32 weights and fp32 arithmetic, read from memory in ~6 bits per weight
instead of 32. Decoding on a CPU is bound by reading the weights once per step, so this is what makes small batches
fast; the fp32 copies are dropped (a tied embedding keeps its own table for lookups). Weights that never were
quantized stay fp32 torch matmuls.

    model = LlamaForCausalLM(cfg, backend, max_positions, plan)    # plan.linear -> PackedLinear
    ... load the checkpoint's weights ...
    pack_linear_weights(model, cache)                             # once, after loading (packed_weight_cache.py)
"""

from __future__ import annotations

import time

import torch
from torch import nn

from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import KIND_NAMES, PackedWeight, pack


class PackedLinear(nn.Linear):
    packed: PackedWeight | None = None     # set once after loading; None: an fp32 torch matmul

    def use_packed(self, packed: PackedWeight) -> None:
        if (packed.out_features, packed.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"packed weight [{packed.out_features}, {packed.in_features}] for a linear "
                             f"[{self.out_features}, {self.in_features}]")
        self.packed = packed
        self.weight = None                 # the fp32 copy goes (the parameter slot stays, empty)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(x)
        y = kernel.packed_linear(x, self.packed, torch.get_num_threads())
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        kind = KIND_NAMES[self.packed.kind] if self.packed is not None else "fp32"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def pack_linear_weights(model: nn.Module, cache=None) -> str:
    """Give every loaded PackedLinear its packed weight where one exists; returns a one-line summary for the log.
    cache: a PackedWeightCache (packed_weight_cache.py), or None to pack without one."""
    layers = {name: m for name, m in model.named_modules()       # not those already holding a form (16-bit)
              if isinstance(m, PackedLinear) and m.packed is None}
    if not layers:
        return "packed weights: every linear already holds its form"
    start = time.perf_counter()
    packed = cache.load(layers) if cache is not None else None
    cached = packed is not None
    if packed is None:
        packed = {name: pack(m.weight.data) if m.weight.device.type == "cpu" else None
                  for name, m in layers.items()}
        if cache is not None:
            cache.store(packed, layers)
    for name, weight in packed.items():
        if weight is not None:
            layers[name].use_packed(weight)
    seconds = time.perf_counter() - start
    took = f"cached ({seconds:.2f} s)" if cached else f"packed in {seconds:.2f} s"
    return f"packed weights: {took}: {_summary(layers, packed)}"


def _summary(layers: dict[str, PackedLinear], packed: dict[str, PackedWeight | None]) -> str:
    done = [p for p in packed.values() if p is not None]
    if not done:
        return f"fp32 torch matmuls (none of {len(layers)} linear weights is exactly Q4_1/Q8_0-quantized)"
    counts: dict[str, int] = {}
    for p in done:
        counts[KIND_NAMES[p.kind]] = counts.get(KIND_NAMES[p.kind], 0) + 1
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    fp32 = sum(p.out_features * p.in_features * 4 for p in done)
    return (f"{len(done)} of {len(layers)} linear weights losslessly ({kinds}): "
            f"{fp32 / 2**20:.0f} MiB fp32 read as {sum(p.nbytes for p in done) / 2**20:.0f} MiB")


def int8_forms(model: nn.Module) -> dict[str, int]:
    """How many packed linears of each form --cpu-int8-activations changes (int8_activations.c's forms)."""
    from steploop.gpu_worker.cpu_kernels.packed_weights import Q4_1, Q4_K, Q6_K, Q8_0
    counts: dict[str, int] = {}
    for module in model.modules():
        packed = getattr(module, "packed", None) if isinstance(module, PackedLinear) else None
        for part in (packed.parts or [packed]) if packed is not None else ():
            if part.kind in (Q4_1, Q8_0, Q4_K, Q6_K):
                counts[KIND_NAMES[part.kind]] = counts.get(KIND_NAMES[part.kind], 0) + 1
    return counts
