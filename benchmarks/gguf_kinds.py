"""The GGUF kernel forms (gpu_worker/gguf/packed_forms.py) side by side on Llama-3.2-1B-shaped layers (hidden
2048, MLP 8192, 32 / 8 heads of 64), random valid blocks of each GGUF type:
    python -m benchmarks.gguf_kinds [--layers 4] [--rows 1 16] [--rounds 5]

One pass is what a forward does with those layers' weights (qkv, o, gate_up, down on [M, 2048] activations).
Kinds alternate round by round (a shared machine is noisy); the best round of each is reported as ms per pass,
the bytes the form reads per pass, and their rate (GB/s: at one row, decoding is bound by reading the weights),
beside torch's fp32 matmul on the same dequantized weights. Writes benchmarks/results/gguf_kinds.json with the
machine (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from benchmarks.machine import machine_info
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import KIND_NAMES
from steploop.gpu_worker.gguf import blocks
from steploop.gpu_worker.gguf.packed_forms import common_form, to_packed
from tests.worker.gguf_files import quantize

RESULTS = pathlib.Path(__file__).parent / "results" / "gguf_kinds.json"
HIDDEN, MLP, Q, KV = 2048, 8192, 2048, 512
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * MLP, HIDDEN), (HIDDEN, MLP)]    # qkv, o, gate_up, down


def layer_forms(qtype: T, layers: int) -> tuple[list, list[torch.Tensor], int]:
    """(packed weights, fp32 weights, bytes of the GGUF tensors) for `layers` layers of one type."""
    packed, dense, file_bytes = [], [], 0
    for i in range(layers):
        for j, (n, k) in enumerate(SHAPES):
            raw = quantize(np.random.default_rng(i * 4 + j).standard_normal((n, k)).astype(np.float32) * 0.02,
                           qtype, seed=i * 4 + j)
            file_bytes += raw.nbytes
            packed.append(to_packed([blocks.decode(raw, qtype, k)], common_form([qtype])))
            dense.append(torch.from_numpy(np.array(gguf_quants.dequantize(raw, qtype), dtype=np.float32)))
    return packed, dense, file_bytes


def one_pass(run, weights, xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        run(w, xs)
    return time.perf_counter() - start


def packed_run(w, xs) -> None:
    kernel.packed_linear(xs[w.in_features], w, torch.get_num_threads())


def torch_run(w, xs) -> None:
    torch.nn.functional.linear(xs[w.shape[1]], w)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q4_1", "Q8_0", "Q5_K", "Q6_K"])
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    forms = {}
    for name in args.types:
        packed, dense, file_bytes = layer_forms(T[name], args.layers)
        forms[name] = (packed, dense if name == args.types[0] else None, file_bytes)
    results = []
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, MLP)}
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, (packed, dense, _) in forms.items():     # alternate kinds within each round
                best[name] = min(best.get(name, 1e9), one_pass(packed_run, packed, xs))
                if dense is not None:
                    best["torch fp32"] = min(best.get("torch fp32", 1e9), one_pass(torch_run, dense, xs))
        for name, seconds in best.items():
            if name == "torch fp32":
                nbytes = sum(w.numel() * 4 for w in forms[args.types[0]][1])
                form, file_bytes = "fp32", None
            else:
                packed, _, file_bytes = forms[name]
                nbytes = sum(p.nbytes for p in packed)
                form = KIND_NAMES[packed[0].kind]
            results.append({"rows": m, "gguf_type": name, "form": form, "ms_per_pass": round(seconds * 1e3, 3),
                            "bytes_per_pass": nbytes, "file_bytes": file_bytes,
                            "GB_per_s": round(nbytes / seconds / 1e9, 2)})
            print(f"rows {m:4d}  {name:10s} as {form:8s} {seconds * 1e3:8.2f} ms/pass  {nbytes / 2**20:7.1f} MiB "
                  f"({'' if file_bytes is None else f'file {file_bytes / 2**20:.1f} MiB, '}"
                  f"{nbytes / seconds / 1e9:.1f} GB/s)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), "threads": threads, "layers": args.layers,
                                   "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
