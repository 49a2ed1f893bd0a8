"""The C paged decode attention (cpu_kernels/paged_attention.c), every build this CPU runs, from DRAM and from L2:

    python -m benchmarks.paged_attention [--contexts 128 512] [--requests 64] [--rounds 8]

SmolLM2's shapes (9 query heads over 3 KV heads, head size 64, block size 16), one decode token per request.
"dram": 30 layers, each on its own cache held as the worker holds its KV pool (host_memory.zeros: huge pages,
faulted in), with the requests' blocks scattered over it, so no layer's K/V is still cached when it comes round;
"l2": every request reads the same few blocks, so the figure is the kernel's compute alone. The gap between the two
is time spent waiting on memory. Builds are timed round-robin (this machine is noisy), the best round counts; GB/s
is the K/V bytes read. Writes benchmarks/results/paged_attention.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from benchmarks.machine import machine_info
from steploop.gpu_worker import host_memory
from steploop.gpu_worker.cpu_kernels import build
from steploop.gpu_worker.cpu_kernels import paged_attention as kernel

RESULTS = pathlib.Path(__file__).parent / "results" / "paged_attention.json"
H, HK, D, BS, LAYERS = 9, 3, 64, 16, 30


def case(requests: int, context: int, resident: bool):
    """(caches, block_tables, q, out, query_start_loc, seq_lens) for one decode token per request."""
    per_req = -(-context // BS)
    blocks = requests * per_req + 1
    caches = []
    for _ in range(1 if resident else LAYERS):
        cache = host_memory.zeros((2, blocks, BS, HK, D), torch.float32)
        cache.normal_()
        caches.append(cache)
    if resident:
        caches = caches * LAYERS
        tables = torch.arange(per_req, dtype=torch.int32).repeat(requests, 1)
    else:
        tables = (torch.randperm(blocks - 1)[: requests * per_req] + 1).view(requests, per_req).to(torch.int32)
    q = torch.randn(requests, H, D)
    return (caches, tables.contiguous(), q, torch.empty_like(q), torch.arange(requests + 1, dtype=torch.int32),
            torch.full((requests,), context, dtype=torch.int32))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="*", default=[128, 512])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    if not kernel.available():
        raise SystemExit("the C kernels did not build (no gcc?)")
    isas, threads = build.runnable_isas(), torch.get_num_threads()
    rows = []
    for context in args.contexts:
        for where in ("dram", "l2"):
            caches, tables, q, out, qsl, seq_lens = case(args.requests, context, where == "l2")
            best = {isa: float("inf") for isa in isas}
            for _ in range(args.rounds):
                for isa in isas:
                    start = time.perf_counter()
                    for cache in caches:
                        kernel.paged_attention(out, q, cache, tables, qsl, seq_lens, D ** -0.5, threads, isa=isa)
                    best[isa] = min(best[isa], (time.perf_counter() - start) / LAYERS)
            kv_bytes = args.requests * context * HK * D * 2 * 4
            for isa, seconds in best.items():
                rows.append({"isa": isa, "context": context, "where": where, "ms_per_layer": seconds * 1e3,
                             "kv_gb_s": kv_bytes / seconds / 1e9})
                print(f"{isa:8s} context {context:5d} {where:4s}: {seconds * 1e3:6.3f} ms a layer "
                      f"({kv_bytes / seconds / 1e9:5.1f} GB/s of K/V)", flush=True)
            del caches
    doc = {"machine": machine_info(), "threads": threads, "requests": args.requests,
           "shape": {"heads": H, "kv_heads": HK, "head_dim": D, "block_size": BS, "layers": LAYERS}, "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
