"""On the CPU in fp32, swap the model's nn.Linear layers whose weights are exactly GGUF-quantized values for
PackedLinear (cpu_kernels/packed_linear.c): the same fp32 weights and fp32 arithmetic, read from memory in ~6 bits
per weight instead of 32. Decoding on a CPU is bound by reading the weights once per step, so this is what makes
small batches fast; the fp32 copies are dropped (the embedding keeps its own table for lookups).

STEPLOOP_CPU_PACKED_WEIGHTS=0 (or STEPLOOP_CPU_KERNELS=0) keeps every layer fp32 torch.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common import envs
from services.gpu_worker.cpu_kernels import packed_linear as kernel
from services.gpu_worker.cpu_kernels.packed_weights import KIND_NAMES, PackedWeight, pack


class PackedLinear(nn.Module):
    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.packed = packed
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = packed.in_features, packed.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernel.packed_linear(x, self.packed, torch.get_num_threads())
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {KIND_NAMES[self.packed.kind]}"


def pack_linear_layers(model: nn.Module) -> str:
    """Replace each packable nn.Linear of a CPU fp32 model in place; returns a one-line summary for the log."""
    off = envs.switched_off(envs.CPU_KERNELS, envs.CPU_PACKED_WEIGHTS)
    if off:
        return f"fp32 torch matmuls ({off}=0)"
    if not kernel.available():
        return "fp32 torch matmuls (the packed linear kernel did not build)"
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    counts: dict[str, int] = {}
    fp32_bytes = packed_bytes = 0
    for parent, name, linear in linears:
        packed = pack(linear.weight.data) if linear.weight.device.type == "cpu" else None
        if packed is None:
            continue
        setattr(parent, name, PackedLinear(packed, linear.bias))
        counts[KIND_NAMES[packed.kind]] = counts.get(KIND_NAMES[packed.kind], 0) + 1
        fp32_bytes += linear.weight.numel() * 4
        packed_bytes += packed.nbytes
    if not counts:
        return f"fp32 torch matmuls (none of {len(linears)} linear weights is exactly Q4_1/Q8_0-quantized)"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return (f"packed {sum(counts.values())} of {len(linears)} linear weights losslessly ({kinds}): "
            f"{fp32_bytes / 2**20:.0f} MiB fp32 read as {packed_bytes / 2**20:.0f} MiB")
