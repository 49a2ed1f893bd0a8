"""The same GGUF file decoded by steploop (read at its own width, in-process ModelRunner) and by llama.cpp
(llama-cpp-python, its own multi-sequence batching), alternating engine by engine in one run:
    python -m benchmarks.gguf_vs_llamacpp [--shape 1b|8b] [--layers N] [--streams 1 16] [--rounds 2] [--file F.gguf]
        [--llama-python .venv-llamacpp/bin/python] [--int8]

Default file: gguf_shapes.py's Llama-3.2-1B-shaped (--shape 8b: Llama-3.1-8B-shaped, ~5 GB) Q4_K_M-like file (Q4_K,
Q6_K for attn_v, ffn_down and the output; random valid blocks), written on first use into --out. Each measurement runs in a fresh process (so its resident size is its own):
greedy, EOS masked, random prompt ids, a closed loop of `streams` concurrent requests, the same threads for both.
Reports output tok/s, the resident size after loading and the peak (ru_maxrss), and steploop / llama.cpp ratios
(the best round of each). llama-cpp-python may live in its own venv (--llama-python); steploop runs in this one.
Writes benchmarks/results/gguf_vs_llamacpp.json with the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

from benchmarks.gguf_shapes import SHAPES, ensure_file

RESULTS = pathlib.Path(__file__).parent / "results" / "gguf_vs_llamacpp.json"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def prompts(streams: int, prompt_len: int, new_tokens: int) -> list[tuple[list[int], int]]:
    import random
    rng = random.Random(0)
    requests = 2 * streams if streams > 1 else 2
    return [([rng.randrange(100, 40000) for _ in range(prompt_len)], new_tokens) for _ in range(requests)]


def copy_bandwidth(threads: int, nbytes: int = 512 * 2**20) -> float:
    """Bytes per second a torch copy of a buffer far larger than the caches moves (read + write counted), the
    median of 5, with the benchmark's threads: the memory bandwidth one decode step's weight reads can have."""
    import torch
    torch.set_num_threads(threads)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)                                              # fault the pages in first
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[2]


def bytes_per_token(model, cfg, context: int) -> int:
    """What one single-stream decode step reads: every linear weight as held (packed or fp32) and the KV cache of
    `context` tokens; the embedding lookup reads one row (left out)."""
    import torch

    from steploop.gpu_worker.model.packed_linear_layer import PackedLinear
    weights = 0
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.packed is not None:
            weights += module.packed.nbytes
        elif isinstance(module, torch.nn.Linear) and module.weight is not None:
            weights += module.weight.numel() * module.weight.element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * context
    return weights + kv


def run_steploop(path: str, streams_list: list[int], threads: int, prompt_len: int, new_tokens: int,
                 int8: bool = False) -> list[dict]:
    """One load, then each stream count in turn (the KV cache sized for the largest); int8: the worker's
    --cpu-int8-activations (Q4_K / Q6_K with int8 activations, as llama.cpp; not exact)."""
    import logging
    logging.basicConfig(level=logging.WARNING)
    import steploop.gpu_worker  # noqa: F401  (before torch loads libgomp: bounds its idle spin, as the worker does)
    import torch
    torch.set_num_threads(threads)
    from benchmarks.inprocess import InProcessEngine
    from steploop.gpu_worker.gguf_convert import convert_gguf
    folder = convert_gguf(path)
    before = rss_mib()
    per_seq = -(-(prompt_len + new_tokens + 8) // 256) * 256             # as llama_cpp_baseline sizes a slot
    engine = InProcessEngine(folder, num_kv_blocks=max(streams_list) * per_seq // 16 + 2, num_threads=threads,
                             max_model_len=per_seq)
    loaded = rss_mib()
    if int8:
        from steploop.gpu_worker.cpu_kernels.packed_linear import set_int8_activations
        set_int8_activations(True)
    engine.run(prompts(1, prompt_len, 4))                       # warm-up, not timed
    outs = []
    for streams in streams_list:
        metrics, _ = engine.run(prompts(streams, prompt_len, new_tokens), max_concurrency=streams)
        out = {"output_throughput": metrics["output_throughput"], "median_itl_ms": metrics["median_itl_ms"],
               "rss_before_load_mib": before, "rss_after_load_mib": loaded}
        if streams == 1:      # the decode step against the memory-bandwidth bound (bytes read / copy bandwidth)
            from steploop.gpu_worker.model.model_config import LlamaModelConfig
            read = bytes_per_token(engine.runner.model, LlamaModelConfig.from_dir(folder),
                                   prompt_len + new_tokens // 2)
            bandwidth = copy_bandwidth(threads)
            out.update({"bytes_per_token_mib": round(read / 2**20, 1),
                        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
                        "bandwidth_bound_ms": round(read / bandwidth * 1000, 2),
                        "itl_over_bound": round(metrics["median_itl_ms"] / (read / bandwidth * 1000), 2)})
        outs.append(out)
    return outs


def run_llama_cpp(path: str, streams_list: list[int], threads: int, prompt_len: int, new_tokens: int) -> list[dict]:
    from benchmarks.llama_cpp_baseline import batched
    before = rss_mib()
    return [{"output_throughput": batched(prompts(streams, prompt_len, new_tokens), n_parallel=streams,
                                          threads=threads, gguf_path=path)["output_throughput"],
             "rss_before_load_mib": before} for streams in streams_list]


def child(args) -> int:
    run = (run_llama_cpp if args.engine == "llama.cpp" else
           functools.partial(run_steploop, int8=args.engine == "steploop-int8"))
    for streams, result in zip(args.streams, run(str(args.file), args.streams, args.threads, args.prompt_len,
                                                  args.tokens)):
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"RESULT {streams} " + json.dumps(result), flush=True)
    return 0


def measure(engine: str, python: str, args, streams_list: list[int]) -> dict[int, dict]:
    """One child process of `engine` running each of streams_list; its result per stream count."""
    cmd = [python, "-m", "benchmarks.gguf_vs_llamacpp", "--engine", engine, "--file", str(args.file), "--streams",
           *map(str, streams_list), "--threads", str(args.threads), "--prompt-len", str(args.prompt_len), "--tokens",
           str(args.tokens)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if engine == "llama.cpp":
        env.update(dict(kv.split("=", 1) for kv in args.llama_env))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [x.split(" ", 2) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or len(lines) != len(streams_list):
        raise RuntimeError(f"{engine} at {streams_list} streams failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {int(streams): json.loads(result) for _, streams, result in lines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=pathlib.Path, default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="the written file's shape (no --file)")
    parser.add_argument("--layers", type=int, default=None, help="layers of the written file (default: the shape's)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/gguf-vs-llamacpp"))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--llama-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python"))
    parser.add_argument("--llama-env", nargs="*", default=["OMP_WAIT_POLICY=PASSIVE"], metavar="KEY=VALUE",
                        help="environment of the llama.cpp runs (default OMP_WAIT_POLICY=PASSIVE: its OpenMP threads "
                             "spin at barriers by default, which a shared machine punishes, 0.3-0.6 vs 6.9 tok/s "
                             "measured, so the ratio would measure spinning, not kernels; steploop bounds its spin "
                             "as its worker does)")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--one-load", action="store_true",
                        help="each engine loads the file once per round and runs every stream count (an 8B file's "
                             "load takes minutes); its peak RSS then covers all of them")
    parser.add_argument("--int8", action="store_true",
                        help="also run steploop with --cpu-int8-activations (llama.cpp's arithmetic; not exact)")
    parser.add_argument("--engine", choices=["steploop", "steploop-int8", "llama.cpp"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        return child(args)
    if args.file is None:
        shape = SHAPES[args.shape]
        args.file = ensure_file(args.out, dataclasses.replace(shape, layers=args.layers or shape.layers))
    if not pathlib.Path(args.llama_python).is_file():
        parser.error(f"--llama-python {args.llama_python}: no such python (the venv holding llama-cpp-python)")
    from benchmarks.machine import machine_info
    machine = machine_info()
    load_at_start = os.getloadavg()
    ask = "import llama_cpp as lc; print(lc.__version__); print(lc.llama_print_system_info().decode().strip())"
    peer = subprocess.run([args.llama_python, "-c", ask], capture_output=True, text=True,
                          check=False).stdout.splitlines()
    machine["llama_cpp_python"], machine["llama_cpp_system_info"] = (peer + [None, None])[:2]
    engines = {"steploop": sys.executable, "llama.cpp": args.llama_python}
    if args.int8:
        engines["steploop-int8"] = sys.executable
    best: dict[tuple[str, int], dict] = {}
    # one child per engine and stream count, or (--one-load: big files) one per engine running every count
    batches = [args.streams] if args.one_load else [[streams] for streams in args.streams]
    for round_ in range(args.rounds):
        for streams_list in batches:
            order = list(engines.items())[::-1 if round_ % 2 else 1]      # ABBA: the other engine first next round
            for engine, python in order:
                for streams, r in measure(engine, python, args, streams_list).items():
                    r["load_avg"] = os.getloadavg()
                    print(f"{engine:13s} {streams:3d} streams: {r['output_throughput']:7.2f} out tok/s, peak RSS "
                          f"{r['peak_rss_mib']:.0f} MiB, load {os.getloadavg()[0]:.1f}", flush=True)
                    key = (engine, streams)
                    if key not in best or r["output_throughput"] > best[key]["output_throughput"]:
                        best[key] = r
    results = []
    for streams in args.streams:
        ours, theirs = best[("steploop", streams)], best[("llama.cpp", streams)]
        results.append({"streams": streams, "steploop": ours, "llama_cpp": theirs,
                        "throughput_ratio": ours["output_throughput"] / theirs["output_throughput"],
                        "peak_rss_ratio": ours["peak_rss_mib"] / theirs["peak_rss_mib"]})
        print(f"{streams:3d} streams: steploop / llama.cpp = {results[-1]['throughput_ratio']:.2f}x tok/s, "
              f"{results[-1]['peak_rss_ratio']:.2f}x peak RSS")
        if ("steploop-int8", streams) in best:
            int8 = best[("steploop-int8", streams)]
            results[-1].update(steploop_int8=int8,
                               int8_throughput_ratio=int8["output_throughput"] / theirs["output_throughput"])
            print(f"  with --cpu-int8-activations: {results[-1]['int8_throughput_ratio']:.2f}x llama.cpp's tok/s, "
                  f"median ITL {int8['median_itl_ms']:.1f} ms")
        if "bandwidth_bound_ms" in ours:
            print(f"  steploop one stream: {ours['median_itl_ms']:.1f} ms/token, bound "
                  f"{ours['bandwidth_bound_ms']:.1f} ms ({ours['bytes_per_token_mib']} MiB / "
                  f"{ours['copy_bandwidth_gb_per_s']} GB/s): "
                  f"{ours['itl_over_bound']}x the bound")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"machine": machine, "file": args.file.name,
                                   "file_mib": round(args.file.stat().st_size / 2**20, 1), "threads": args.threads,
                                   "llama_env": args.llama_env, "one_load": args.one_load,
                                   "prompt_len": args.prompt_len, "tokens": args.tokens, "rounds": args.rounds,
                                   "results": results, "load_avg_start_end": [load_at_start, os.getloadavg()],
                                   "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
