"""The packed fp32 matmul (cpu_kernels/packed_linear.c) vs torch's fp32 matmul on the default model's real weights:
    python -m benchmarks.packed_linear [--rows 1 4 8 16 32 64 256] [--rounds 5] [--isa avx2]

One "pass" is what a forward does with the weights: for each of the 30 layers qkv, o, gate_up and down on [M, in]
activations, then lm_head, so the weights stream from memory as in serving (one layer's weights would sit in
cache). torch and packed alternate round by round (this machine is noisy); the best round of each is reported, as
ms per pass, GFLOP/s and the ratio. Writes benchmarks/results/packed_linear.json.

    python -m benchmarks.packed_linear --form bf16      # or fp16

times a 16-bit checkpoint of the same shapes instead (the weights rounded to bf16 / fp16): its 16-bit form
(steploop_packed_linear_w16, model/half_weights.py) against torch's fp32 matmul on the upcast weights, which is how
such a checkpoint ran before it was kept at 16 bits. Writes benchmarks/results/packed_linear_<form>.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch
from safetensors import safe_open

from benchmarks.machine import machine_info
from steploop.common.model_path import resolve_model
from steploop.gpu_worker.cpu_kernels import packed_linear as kernel
from steploop.gpu_worker.cpu_kernels.packed_weights import pack, pack_w16

RESULTS = pathlib.Path(__file__).parent / "results" / "packed_linear.json"
FORMS = {"gguf": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def layer_weights(model_dir: pathlib.Path) -> list[torch.Tensor]:
    """[N, K] fp32 weights in forward order, fused like the worker's model (qkv, gate_up)."""
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        get = f.get_tensor
        layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
        out = []
        for i in layers:
            p = f"model.layers.{i}."
            out.append(torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]))
            out.append(get(p + "self_attn.o_proj.weight"))
            out.append(torch.cat([get(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]))
            out.append(get(p + "mlp.down_proj.weight"))
        out.append(get("lm_head.weight") if "lm_head.weight" in names else get("model.embed_tokens.weight"))
    return out


def packed_flops(model_dir: pathlib.Path, rows=(64, 256), windows: int = 6, seconds: float = 0.4) -> dict[int, float]:
    """The packed kernel's FLOP/s on layer 0's real weights (qkv, o, gate_up, down), measured the way
    hf_baseline.matmul_flops measures torch's (one layer's weights, so they sit in cache; best of `windows`)."""
    weights = layer_weights(model_dir)[:4]
    packed = [pack(w) for w in weights]
    threads = torch.get_num_threads()
    out = {}
    for m in rows:
        xs = [torch.randn(m, w.shape[1]) for w in weights]
        flop = sum(2 * m * w.numel() for w in weights)
        best = 0.0
        for _ in range(windows):
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for x, pk in zip(xs, packed):
                    kernel.packed_linear(x, pk, threads)
                reps += 1
            best = max(best, flop * reps / (time.perf_counter() - start))
        out[m] = best
    return out


def time_pass(fns: list, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for fn in fns:
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--isa", default=None, help="the kernel build to time (build.py ISAS; default: the host's)")
    p.add_argument("--int8", action="store_true",
                   help="also time the packed kernel with --cpu-int8-activations' arithmetic (int8_activations.c: "
                        "not exact), alternating with the others; writes packed_linear_int8.json")
    p.add_argument("--form", choices=sorted(FORMS), default="gguf",
                   help="gguf: the file's Q4_1 / Q8_0 weights packed; bf16 / fp16: a 16-bit checkpoint's")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    weights = layer_weights(resolve_model(None))
    half = FORMS[args.form]
    if half is not None:            # the 16-bit checkpoint: torch multiplies its values upcast to fp32
        packed = [pack_w16(w.to(half)) for w in weights]
        weights = [w.to(half).float() for w in weights]
    else:
        packed = [pack(w) for w in weights]
    if any(pk is None for pk in packed) or not kernel.available(args.isa):
        raise SystemExit("the model's weights do not all pack, or the kernel did not build")
    fp32_mb = sum(w.numel() * 4 for w in weights) / 2**20
    packed_mb = sum(pk.nbytes for pk in packed) / 2**20
    print(f"{len(weights)} weights: {fp32_mb:.0f} MiB fp32, {packed_mb:.0f} MiB packed; {threads} threads", flush=True)
    rows = []
    for m in args.rows:
        xs = [torch.randn(m, w.shape[1]) for w in weights]
        flop = sum(2 * m * w.numel() for w in weights)
        torch_fns = [lambda x=x, w=w: torch.matmul(x, w.T) for x, w in zip(xs, weights)]
        packed_fns = [lambda x=x, pk=pk: kernel.packed_linear(x, pk, threads, isa=args.isa)
                      for x, pk in zip(xs, packed)]
        torch_s = packed_s = int8_s = float("inf")
        for _ in range(args.rounds):                       # alternate, so drift hits both alike
            torch_s = min(torch_s, time_pass(torch_fns, 1))
            packed_s = min(packed_s, time_pass(packed_fns, 1))
            if args.int8:
                kernel.set_int8_activations(True, isa=args.isa)
                try:
                    int8_s = min(int8_s, time_pass(packed_fns, 1))
                finally:
                    kernel.set_int8_activations(False, isa=args.isa)
        row = {"rows": m, "torch_ms": torch_s * 1e3, "packed_ms": packed_s * 1e3,
               "torch_gflops": flop / torch_s / 1e9, "packed_gflops": flop / packed_s / 1e9,
               "speedup": torch_s / packed_s}
        line = (f"M={m:4d}: torch {row['torch_ms']:7.1f} ms ({row['torch_gflops']:5.1f} GFLOP/s)   packed "
                f"{row['packed_ms']:7.1f} ms ({row['packed_gflops']:5.1f} GFLOP/s)   {row['speedup']:.2f}x")
        if args.int8:
            row.update(int8_ms=int8_s * 1e3, int8_gflops=flop / int8_s / 1e9, int8_over_packed=packed_s / int8_s)
            line += f"   int8 {row['int8_ms']:7.1f} ms ({row['int8_gflops']:5.1f} GFLOP/s) {row['int8_over_packed']:.2f}x"
        rows.append(row)
        print(line, flush=True)
    out = RESULTS if half is None else RESULTS.with_name(f"packed_linear_{args.form}.json")
    if args.int8:
        out = out.with_name(out.stem + "_int8.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "form": args.form, "threads": threads, "int8": args.int8,
                               "isa": args.isa or "host", "fp32_mib": fp32_mb, "packed_mib": packed_mb,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
