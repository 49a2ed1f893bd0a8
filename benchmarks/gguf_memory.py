"""Weights in memory for a GGUF file read at its own width: a Llama-3.2-1B- or 3.1-8B-shaped Q4_K_M-like file
(gguf_shapes.py: random valid blocks, Q4_K with Q6_K for attn_v, ffn_down and the output, F32 norms; the default
model's tokenizer) written to a folder, loaded by the ModelRunner on the CPU, one greedy step run:
    python -m benchmarks.gguf_memory [--shape 1b|8b] [--layers N] [--out /tmp/gguf-memory]

Reports the file's size, the worker's "GGUF weights in memory" line, and the process's resident size before
loading, after, and its peak (ru_maxrss). Writes benchmarks/results/gguf_memory.json with the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import resource
import time

from benchmarks.gguf_shapes import SHAPES, ensure_file
from benchmarks.machine import machine_info

RESULTS = pathlib.Path(__file__).parent / "results" / "gguf_memory.json"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/gguf-memory"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    shape = dataclasses.replace(shape, layers=args.layers or shape.layers)
    path = ensure_file(args.out, shape)                  # before the cache dir moves to the out folder
    os.environ["STEPLOOP_CACHE_DIR"] = str(args.out / "cache")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logging.basicConfig(level=logging.INFO)
    logging.getLogger().addHandler(Keep())

    import torch

    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.gguf_convert import convert_gguf
    from steploop.gpu_worker.model_runner import ModelRunner
    folder = convert_gguf(path)
    before = rss_mib()
    start = time.perf_counter()
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=40, max_model_len=512,
                                                  device="cpu"), folder)
    load_s = time.perf_counter() - start
    after = rss_mib()
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        runner.model.model.embed_tokens(ids)
    weights_line = next((line for line in lines if line.startswith("GGUF weights in memory")), None)
    result = {"file": path.name, "file_mib": round(path.stat().st_size / 2**20, 1), "layers": shape.layers,
              "weights_in_memory": weights_line, "rss_before_load_mib": round(before, 1),
              "rss_after_load_mib": round(after, 1), "peak_rss_mib": round(resource.getrusage(
                  resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "load_seconds": round(load_s, 1)}
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
