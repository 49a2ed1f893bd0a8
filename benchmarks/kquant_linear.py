"""The packed k-quant matmul (cpu_kernels/packed_linear.c) vs torch's fp32 matmul on the same dequantized weights,
at a Llama-3.2-1B's Q4_K_M shapes (random valid blocks):
    python -m benchmarks.kquant_linear [--layers 4] [--rows 1 16] [--rounds 5] [--isa avx2] [--int8]
                                       [--int8-versus avx2]

One pass is what `layers` decoder layers do with their weights: qkv (Q4_K q, k + Q6_K v, in the form the worker
fuses them to), o (Q4_K), gate_up (Q4_K), down (Q6_K), on [M, in] activations; `layers` distinct copies so the
weights stream from memory as in serving. torch and packed alternate round by round; the best round of each is
reported as ms per pass, GB/s of packed weights read (M = 1) and GFLOP/s, with the load average.
"""

from __future__ import annotations

import argparse
import os
import time

import steploop.gpu_worker  # noqa: F401,I001  (before torch loads libgomp: bounds its idle spin, as the worker does)
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import unpack
from steploop.gpu_worker.gguf import blocks
from steploop.gpu_worker.gguf.packed_forms import common_form, to_packed
from tests.worker.gguf_files import quantize

HIDDEN, INTER, KV = 2048, 8192, 512
# (parts' (rows, type), in features) per fused linear of one layer, Q4_K_M's types
LAYER = [([(HIDDEN, T.Q4_K), (KV, T.Q4_K), (KV, T.Q6_K)], HIDDEN), ([(HIDDEN, T.Q4_K)], HIDDEN),
         ([(INTER, T.Q4_K), (INTER, T.Q4_K)], HIDDEN), ([(HIDDEN, T.Q6_K)], INTER)]


def layer_weights(seed: int):
    out = []
    for parts, k in LAYER:
        decoded = [blocks.decode(quantize(np.zeros((n, k), np.float32), t, seed=seed + i), t, k)
                   for i, (n, t) in enumerate(parts)]
        qtypes = [t for _, t in parts]
        out.append(to_packed(decoded, common_form(qtypes), qtypes))
    return out


def time_pass(fns) -> float:
    start = time.perf_counter()
    for fn in fns:
        fn()
    return time.perf_counter() - start


def time_int8(fns, isa: str | None) -> float:
    """One pass with the int8-activation kernels of that build switched on."""
    kernel.set_int8_activations(True, isa=isa)
    try:
        return time_pass(fns)
    finally:
        kernel.set_int8_activations(False, isa=isa)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--isa", default=None, help="the kernel build to time (build.py ISAS; default: the host's)")
    p.add_argument("--no-torch", action="store_true", help="time the packed kernel only")
    p.add_argument("--int8", action="store_true",
                   help="also time the int8-activation kernels (--cpu-int8-activations; not exact), alternating")
    p.add_argument("--int8-versus", default=None, metavar="ISA",
                   help="with --int8: also time the int8 kernels of this build, alternating (e.g. avx2's maddubs "
                        "against the host's VNNI)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    packed = [pk for i in range(args.layers) for pk in layer_weights(100 * i)]
    weights = [] if args.no_torch else [unpack(pk) for pk in packed]
    nbytes = sum(pk.nbytes for pk in packed)
    forms = sorted({pk.describe() for pk in packed})
    print(f"{len(packed)} weights, forms {forms}: {nbytes / 2**20:.0f} MiB packed; {threads} threads; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    for m in args.rows:
        xs = [torch.randn(m, pk.in_features) for pk in packed]
        flop = sum(2 * m * pk.in_features * pk.out_features for pk in packed)
        packed_fns = [lambda x=x, pk=pk: kernel.packed_linear(x, pk, threads, isa=args.isa) for x, pk in zip(xs, packed)]
        torch_fns = [lambda x=x, w=w: torch.matmul(x, w.T) for x, w in zip(xs, weights)]
        versus_fns = [lambda x=x, pk=pk: kernel.packed_linear(x, pk, threads, isa=args.int8_versus)
                      for x, pk in zip(xs, packed)]
        torch_s = packed_s = int8_s = versus_s = float("inf")
        for _ in range(args.rounds):                        # alternate, so drift hits both alike
            if torch_fns:
                torch_s = min(torch_s, time_pass(torch_fns))
            packed_s = min(packed_s, time_pass(packed_fns))
            if args.int8:
                int8_s = min(int8_s, time_int8(packed_fns, args.isa))
                if args.int8_versus:
                    versus_s = min(versus_s, time_int8(versus_fns, args.int8_versus))
        line = (f"M={m:3d}: packed {packed_s * 1e3:7.1f} ms ({flop / packed_s / 1e9:5.1f} GFLOP/s, "
                f"{nbytes / packed_s / 1e9:5.1f} GB/s)")
        if torch_fns:
            line += f"   torch fp32 {torch_s * 1e3:7.1f} ms ({flop / torch_s / 1e9:5.1f} GFLOP/s)   " \
                    f"{torch_s / packed_s:.2f}x"
        if args.int8:
            line += f"   int8 activations {int8_s * 1e3:7.1f} ms ({packed_s / int8_s:.2f}x the exact kernels)"
        if args.int8 and args.int8_versus:
            line += f"   int8 on {args.int8_versus} {versus_s * 1e3:7.1f} ms ({versus_s / int8_s:.2f}x slower)"
        print(line + f"   load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
