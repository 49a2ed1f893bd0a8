"""Random LoRA problems for the kernel tests: stacked adapters, a batch with base-model rows between adapter
rows, and the step's segments."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from steploop.gpu_worker.lora.segments import LoraSegments, build_lora_segments


@dataclass
class LoraCase:
    x: torch.Tensor            # [T, H]
    lora_a: torch.Tensor       # [L, R, H]
    lora_b: torch.Tensor       # [L, N, R]
    scale: torch.Tensor        # [L] fp32
    y: torch.Tensor            # [T, N_total] base output the expand adds to
    token_slots: list[int]     # [T] -1 = base model
    seg: LoraSegments

    def to(self, device: torch.device) -> LoraCase:
        return LoraCase(self.x.to(device), self.lora_a.to(device), self.lora_b.to(device), self.scale.to(device),
                        self.y.to(device, copy=True), self.token_slots, self.seg.to(device))   # y is written


def make_case(token_slots: list[int], hidden: int, n: int, rank: int, dtype: torch.dtype, num_slots: int = 8,
              n_total: int | None = None, seed: int = 0) -> LoraCase:
    gen = torch.Generator().manual_seed(seed)
    t = len(token_slots)

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(dtype)

    return LoraCase(x=rand(t, hidden), lora_a=rand(num_slots, rank, hidden, std=hidden ** -0.5),
                    lora_b=rand(num_slots, n, rank, std=rank ** -0.5),
                    scale=torch.rand(num_slots, generator=gen) + 0.5, y=rand(t, n_total or n),
                    token_slots=token_slots, seg=build_lora_segments(torch.tensor(token_slots, dtype=torch.int32)))


MIXED = [3, -1, 0, 0, -1, 5, 3, 3, 0, 7, -1, 5, 1]   # many segments of mixed lengths, slots out of order
DECODE = [-1, -1, 2, -1]                             # T' = 1
CHUNK = [4] * 70 + [-1] * 3 + [1] * 17               # a long prompt chunk (two row tiles) beside a short one
WHOLE = [6] * 20                                     # every row on one adapter (the CPU path skips the gather)
