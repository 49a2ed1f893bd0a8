"""The CPU LoRA path (kernels/lora_ops.py: shrink + expand per projection) vs the base matmuls it rides on:
    python -m benchmarks.lora_kernels [--tokens 64] [--adapters 4 1] [--rank 16] [--rounds 7] [--threads N]

One "layer" is what a forward does per decoder layer, on the default model's shapes (config.json): the base
qkv, o, gate_up and down matmuls (torch fp32, weights [N, K]), and with LoRA on every one of those targets: qkv
as one stacked shrink [L, 3R, H] and one lora_expand_slices over its three slices, gate_up likewise with two,
o and down one shrink and one expand each. (B stacked block-diagonally [L, N_total, sum R_i], so a fused output
expands in one lora_expand, measured 5-8% slower than lora_expand_slices: fewer but wider GEMMs.)
Base and base+LoRA alternate round by round (this machine is noisy); the best round of each is reported, as
ms per layer and the ratio base / (base + LoRA), i.e. the throughput factor if matmuls were the whole step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from steploop.common.model_path import resolve_model
from steploop.gpu_worker.kernels.lora_ops import lora_expand_slices, lora_shrink
from steploop.gpu_worker.lora.segments import build_lora_segments


def projections(cfg: dict) -> list[tuple[int, list[int]]]:
    """(input size, output slices) of each base matmul of one layer."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or 64
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return [(h, [q, kv, kv]), (q, [h]), (h, [inter, inter]), (inter, [h])]


def run(tokens: int, adapters: int, rank: int, rounds: int, max_loras: int = 8) -> dict:
    cfg = json.loads((resolve_model(None) / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(tokens, dtype=torch.int32) % adapters                  # requests spread over adapters
    seg = build_lora_segments(slots)
    layer = []
    for k, outs in projections(cfg):
        w = torch.randn((sum(outs), k), generator=gen) * k ** -0.5
        a = torch.randn((max_loras, rank * len(outs), k), generator=gen) * k ** -0.5
        bs = [torch.randn((max_loras, n, rank), generator=gen) * rank ** -0.5 for n in outs]
        layer.append((torch.randn((tokens, k), generator=gen), w, a, bs, outs))
    scale = torch.full((max_loras,), 2.0)

    def base() -> None:
        for x, w, *_ in layer:
            torch.mm(x, w.t())

    def with_lora() -> None:
        for x, w, a, bs, outs in layer:
            y = torch.mm(x, w.t())
            lora_expand_slices(y, lora_shrink(x, a, seg, scale), bs, seg, [sum(outs[:i]) for i in range(len(outs))])

    fns = {"base": base, "base+lora": with_lora}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < 0.3:
                fn()
                reps += 1
            best[name] = min(best[name], (time.perf_counter() - start) / reps)
    return {"tokens": tokens, "adapters": adapters, "rank": rank, "threads": torch.get_num_threads(),
            "base_ms_per_layer": round(best["base"] * 1e3, 3),
            "base_plus_lora_ms_per_layer": round(best["base+lora"] * 1e3, 3),
            "ratio": round(best["base"] / best["base+lora"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--adapters", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for tokens in args.tokens:
        for adapters in args.adapters:
            print(json.dumps(run(tokens, adapters, args.rank, args.rounds)))


if __name__ == "__main__":
    main()
