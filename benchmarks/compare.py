"""Side-by-side ratios on this machine, same model, same prompts, ONE run:  python benchmarks/compare.py [--quick]

 (a)  steploop (gRPC cluster, 64 concurrent, mixed lengths) vs transformers `generate` fp32: one request at a
      time (target >= 6x) and padded static batches (>= 1.5x), output-token throughput
 (a') steploop output tok/s x 2 x params / fp32 matmul FLOP/s on the model's layer shapes (>= 60%)
 (b)  gRPC cluster vs the same scheduler + ModelRunner in one process (>= 0.92x throughput, <= +1 ms mean TPOT)
 (c)  prefix caching on vs off: TTFT on a 1024-token shared prefix (>= 5x); throughput at 0% hits (>= 0.99x)
 (d)  chunked prefill: p99 ITL of running streams while 2k-token prompts arrive, default budget vs a budget that
      takes each prompt whole (target: p99 <= 2x median with the default budget)
 (e)  steploop vs llama.cpp (llama-cpp-python) on the GGUF: skipped when not installed

Writes benchmarks/results/compare.{json,md} and compare-*.png. Clusters are real processes on free ports
(tests/integration/cluster.py). Other processes on the machine skew absolute figures; ratios are measured
back to back in this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import compare_report as report
from services.bench import datasets, plots
from services.bench.client import Target
from services.bench.runner import run as bench_run
from services.common.model_path import DEFAULT_MODEL, resolve_model
from tests.integration.cluster import Cluster

RESULTS = ROOT / "benchmarks" / "results"
NUM_KV_BLOCKS = 2048          # 32k tokens of KV: every workload here fits without preemption


class Workloads:
    def __init__(self, quick: bool):
        self.quick = quick
        self.concurrency = 16 if quick else 64
        # decode-heavy, like chat: (a') divides output tok/s by the FLOP limit, so prompt tokens must be the minority
        self.input_len, self.output_len, self.range_ratio = (32, 16, 0.5) if quick else (32, 64, 0.5)
        self.hf_single = 2 if quick else 4             # requests timed one at a time (a subset of the 64)
        self.hf_batch = self.concurrency               # one padded static batch of all of them
        self.prefix_len, self.suffix_len, self.prefix_requests = 1024, 32, (2 if quick else 4)
        self.miss_requests, self.miss_input, self.miss_output = (8, 64, 8) if quick else (32, 128, 16)
        self.streams, self.stream_output = (4, 40) if quick else (8, 96)
        self.long_prompts, self.long_len, self.long_every = (1, 2048, 1.5) if quick else (2, 2048, 3.0)


def machine_info() -> dict:
    import torch
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines() if os.path.exists("/proc/cpuinfo") else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_average_at_start": os.getloadavg()}


THREADS: list[str] = []       # ["--num-threads", N] for the worker when --threads is given


def start_cluster(name: str, scheduler_args=()) -> Cluster:
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"compare-{name}-"))
    cluster = Cluster(log_dir, scheduler_args=list(scheduler_args), worker_args=THREADS,
                      num_kv_blocks=NUM_KV_BLOCKS)
    print(f"[{name}] starting cluster {' '.join(scheduler_args)} (logs {log_dir})", flush=True)
    try:
        return cluster.start(timeout=300)
    except BaseException:
        cluster.stop()
        raise


def bench(cluster: Cluster, reqs, warm=(), concurrency=None, tokenizer=None):
    target = Target(cluster.base_url, DEFAULT_MODEL)
    summary, results = asyncio.run(bench_run(target, reqs, max_concurrency=concurrency, warmups=list(warm),
                                             tokenizer=tokenizer, progress=False))
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary.get('errors')}")
    return summary, results


def ids_of(reqs) -> list[tuple[list[int], int]]:
    return [(list(r.token_ids), r.output_len) for r in reqs]


# ---- (d): running streams while long prompts arrive ---------------------------------------------------------
async def _streams_with_long_prompts(cluster: Cluster, w: Workloads, streams, longs):
    from services.bench.runner import run as run_
    target = Target(cluster.base_url, DEFAULT_MODEL)

    async def longs_later():
        await asyncio.sleep(1.0)         # then one every long_every s, while the streams decode
        return await run_(target, longs, request_rate=1.0 / w.long_every, burstiness=1e6, progress=False)

    (s_sum, s_res), (l_sum, _) = await asyncio.gather(
        run_(target, streams, progress=False), longs_later())
    return s_sum, s_res, l_sum


def chunked_prefill(cluster: Cluster, w: Workloads, tok) -> dict:
    streams = datasets.random_dataset(w.streams, 64, w.stream_output, 0.0, tok, seed=7, as_ids=True)
    longs = datasets.random_dataset(w.long_prompts, w.long_len, 2, 0.0, tok, seed=8, as_ids=True)
    bench(cluster, datasets.random_dataset(1, 16, 2, 0.0, tok, seed=9, as_ids=True))       # warm-up
    s_sum, s_res, l_sum = asyncio.run(_streams_with_long_prompts(cluster, w, streams, longs))
    return {"p99_itl_ms": s_sum["p99_itl_ms"], "median_itl_ms": s_sum["median_itl_ms"],
            "max_itl_ms": max(g for r in s_res for g in r.itl) * 1000,
            "p99_over_median": s_sum["p99_itl_ms"] / s_sum["median_itl_ms"],
            "long_prompt_mean_ttft_ms": l_sum["mean_ttft_ms"], "stream_output_throughput": s_sum["output_throughput"],
            "_results": s_res}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~3-minute smoke version (smaller workloads)")
    parser.add_argument("--out", default=str(RESULTS), help="results folder")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every engine (worker, in-process, HF, matmul); default: all cores")
    parser.add_argument("--replot", action="store_true", help="rewrite compare.md and the bar plots from compare.json, then exit")
    args = parser.parse_args(argv)
    if args.replot:
        doc = json.loads((pathlib.Path(args.out) / "compare.json").read_text())
        report.write(pathlib.Path(args.out), doc["machine"], argparse.Namespace(**doc["workloads"]), doc["figures"],
                     doc["ratios"])
        write_bar_plots(pathlib.Path(args.out), doc["figures"], doc["ratios"])
        return
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
        THREADS[:] = ["--num-threads", str(args.threads)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))        # so clusters are stopped in finally blocks
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    w = Workloads(args.quick)
    began = time.perf_counter()
    model_dir = resolve_model(None)
    tok = datasets.load_tokenizer(None)
    info = machine_info()
    print(f"machine: {info}", flush=True)
    mixed = datasets.random_dataset(w.concurrency, w.input_len, w.output_len, w.range_ratio, tok, seed=1,
                                    as_ids=True)
    figures: dict = {}
    raw: dict = {}

    # (a') the machine's limit, first, while nothing of ours runs
    import json as _json

    from benchmarks import hf_baseline
    cfg = _json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    flops = hf_baseline.matmul_flops(cfg["hidden_size"], cfg["intermediate_size"], heads * head_dim,
                                     kv_heads * head_dim)
    figures["matmul_gflops"] = {str(k): v / 1e9 for k, v in flops.items()}
    print(f"fp32 matmul on layer shapes: {figures['matmul_gflops']} GFLOP/s", flush=True)

    # (a) transformers baselines, in this process
    model = hf_baseline.load(model_dir)
    params = sum(p.numel() for p in model.parameters())
    figures["params"] = params
    pairs = ids_of(mixed)
    single = pairs[::max(1, len(pairs) // w.hf_single)][:w.hf_single]
    figures["hf_one_at_a_time"] = hf_baseline.one_at_a_time(model, single)
    print(f"hf one-at-a-time: {figures['hf_one_at_a_time']}", flush=True)
    figures["hf_static_batch"] = hf_baseline.static_batches(model, pairs, w.hf_batch)
    print(f"hf static batch: {figures['hf_static_batch']}", flush=True)
    del model

    # (b) in-process engine, same prompts
    from benchmarks.inprocess import InProcessEngine
    engine = InProcessEngine(model_dir, NUM_KV_BLOCKS, num_threads=args.threads)
    engine.run(ids_of(datasets.random_dataset(2, 16, 4, 0.0, tok, seed=9, as_ids=True)))     # warm-up
    figures["inprocess"], raw["inprocess"] = engine.run(pairs)
    print(f"in-process: {report.short(figures['inprocess'])}", flush=True)
    del engine

    # cluster A: default flags -- (a), (b), (c) on, (d) default budget
    warm = datasets.random_dataset(2, 16, 4, 0.0, tok, seed=9, as_ids=True)
    prefix_reqs = datasets.shared_prefix_dataset(1, w.prefix_requests + 1, w.prefix_len, w.suffix_len, 8, tok,
                                                 seed=3, as_ids=True)
    misses = datasets.random_dataset(w.miss_requests, w.miss_input, w.miss_output, 0.0, tok, seed=4, as_ids=True)
    cluster = start_cluster("default")
    try:
        figures["cluster"], raw["cluster"] = bench(cluster, mixed, warm, concurrency=w.concurrency)
        print(f"cluster: {report.short(figures['cluster'])}", flush=True)
        figures["prefix_on"], _ = bench(cluster, prefix_reqs[1:], prefix_reqs[:1], concurrency=1)
        figures["misses_on"], _ = bench(cluster, misses, concurrency=w.miss_requests)
        figures["chunked_default"] = chunked_prefill(cluster, w, tok)
    finally:
        cluster.stop()
    cluster = start_cluster("no-prefix-caching", ["--no-enable-prefix-caching"])
    try:
        bench(cluster, warm)
        figures["prefix_off"], _ = bench(cluster, prefix_reqs[1:], prefix_reqs[:1], concurrency=1)
        figures["misses_off"], _ = bench(cluster, misses, concurrency=w.miss_requests)
    finally:
        cluster.stop()
    whole = str(w.long_len + 2 * w.streams + 64)
    cluster = start_cluster("whole-prompt-budget", ["--max-num-batched-tokens", whole])
    try:
        figures["chunked_whole"] = chunked_prefill(cluster, w, tok)
    finally:
        cluster.stop()
    if not w.quick:
        cluster = start_cluster("budget-256", ["--max-num-batched-tokens", "256"])
        try:
            figures["chunked_256"] = chunked_prefill(cluster, w, tok)
        finally:
            cluster.stop()

    figures["llama_cpp"] = llama_cpp_figures(single, args.threads)
    info["load_average_at_end"] = os.getloadavg()
    info["wall_seconds"] = time.perf_counter() - began
    info["quick"] = w.quick
    ratios = report.ratios(figures)
    report.write(out_dir, info, w, figures, ratios)
    write_plots(out_dir, figures, raw, ratios)
    print(report.markdown_table(ratios))
    print(f"done in {info['wall_seconds']:.0f} s; results in {out_dir}")


def llama_cpp_figures(single, threads: int | None) -> dict:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {"skipped": "not installed (pip install llama-cpp-python; building it takes ~9 minutes)"}
    from benchmarks.llama_cpp_baseline import one_at_a_time
    return one_at_a_time(single, threads)


def write_plots(out_dir: pathlib.Path, figures: dict, raw: dict, ratios: list[dict]) -> None:
    plots.plot_distributions([("grpc cluster", raw["cluster"]), ("in-process", raw["inprocess"])],
                             out_dir / "compare-ttft-itl.png")
    chunk_runs = [(k.removeprefix("chunked_"), figures[k]["_results"]) for k in
                  ("chunked_default", "chunked_whole", "chunked_256") if k in figures]
    plots.plot_distributions(chunk_runs, out_dir / "compare-chunked-prefill.png")
    write_bar_plots(out_dir, figures, ratios)


def write_bar_plots(out_dir: pathlib.Path, figures: dict, ratios: list[dict]) -> None:
    """Throughputs and measured/target; also `--replot`, from compare.json alone."""
    tput = {"steploop cluster": figures["cluster"]["output_throughput"],
            "steploop in-process": figures["inprocess"]["output_throughput"],
            "hf static batch": figures["hf_static_batch"]["output_throughput"],
            "hf one at a time": figures["hf_one_at_a_time"]["output_throughput"]}
    if "output_throughput" in figures["llama_cpp"]:
        tput["llama.cpp one at a time"] = figures["llama_cpp"]["output_throughput"]
    plots.plot_bars(list(tput), list(tput.values()), "output tok/s, mixed-length requests", "tok/s",
                    out_dir / "compare-throughput.png")
    shown = [r for r in ratios if r["value"] is not None and r["unit"] != "ms"]
    labels = [r["name"].replace(", ", "\n", 1) + ("" if r["higher_is_better"] else " (inv.)") for r in shown]
    scores = [r["value"] / r["target"] if r["higher_is_better"] else r["target"] / max(r["value"], 1e-9)
              for r in shown]
    plots.plot_bars(labels, scores, "measured / target (>= 1 passes)", "x target", out_dir / "compare-ratios.png")


if __name__ == "__main__":
    main()
