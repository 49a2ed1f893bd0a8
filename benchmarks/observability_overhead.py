"""What metrics and tracing cost in throughput:  python -m benchmarks.observability_overhead [--quick] [--rounds N]

1. End to end (the acceptance figure: metrics and tracing cost <= 2% of output-token throughput). Three real
   clusters (gateway, scheduler and worker processes on loopback, tests/integration/cluster.py, the default
   model), one per configuration, all started first and kept up; the same workload (fixed-length prompts sent as
   token ids, greedy, ignore_eos so every request generates exactly --output-len tokens) goes to one cluster at a
   time, round by round, the order rotated each round (off metrics tracing, metrics tracing off, ...), so drift
   in the machine's load spreads over all three. Each round uses fresh prompts (no prefix-cache hits), the same
   for the three configurations.

     off      --disable-log-stats on all three services: no metric recorded, no per-request or stats log line,
              no span (the hooks are no-ops); nobody scrapes
     metrics  the defaults: metrics recorded in all three services, the scheduler's per-request INFO line and 10 s
              stats line (to its log file); tracing off; the gateway's /metrics (which fetches the engine's) is
              scraped every --scrape-interval s during the load, as Prometheus would
     tracing  metrics as above, plus --otlp-traces-endpoint on all three services, exporting OTLP/gRPC (batched)
              to a collector in this process (opentelemetry-proto's TraceService, counting spans). After each
              tracing run the benchmark waits until the collector has every span, so no export spills into the
              next configuration's run.

   Reports output tok/s per configuration (median, min-max), the per-round ratios on/off (median, min-max), the
   cost (1 - median ratio) and the spans received; and CPU time per output token of the three service processes
   (/proc/PID/stat), the steadier measure on a shared machine, with its on/off ratios.
2. Scheduler-only loop (the worst case: no forward, no gRPC). The real Scheduler with a fake worker, the
   EngineObserver hooks called where EngineLoop calls them: off (no hooks) / metrics / tracing (SDK provider,
   spans dropped). Time per step, the ratio, and that added time as a share of a step with a --forward-ms forward.

Writes benchmarks/results/observability_overhead.json ({"e2e": ..., "scheduler_only": ...}; with --only, the other
section is kept from the file).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import logging
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent import futures
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "observability_overhead.json"
CONFIGS = ("off", "metrics", "tracing")
SPANS_PER_REQUEST = 5      # gateway HTTP + GenAI client, scheduler request + queue, worker prefill
TARGET_COST = 0.02


# ---- 1. end to end ----------------------------------------------------------------------------------------------
class SpanSink:
    """An OTLP/gRPC trace collector that counts spans by service.name and answers success. The gateway's
    `GET /health` spans (the cluster's readiness polls) are counted apart, so `total` is the requests' spans."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self
        self.lock = threading.Lock()
        self.by_service: Counter[str] = Counter()
        self.health = self.exports = 0

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with sink.lock:
                    sink.exports += 1
                    for rs in request.resource_spans:
                        name = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"),
                                    "?")
                        for ss in rs.scope_spans:
                            health = sum(span.name == "GET /health" for span in ss.spans)
                            sink.health += health
                            sink.by_service[name] += len(ss.spans) - health
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def total(self) -> int:
        with self.lock:
            return sum(self.by_service.values())

    def wait_for(self, expected: int, timeout: float) -> float:
        """Seconds until `expected` spans arrived (or timeout)."""
        start = time.monotonic()
        while self.total < expected and time.monotonic() - start < timeout:
            time.sleep(0.05)
        return time.monotonic() - start

    def stop(self) -> None:
        self.server.stop(grace=1.0)


def service_flags(config: str, endpoint: str) -> list[str]:
    return {"off": ["--disable-log-stats"], "metrics": [],
            "tracing": ["--otlp-traces-endpoint", endpoint]}[config]


def start_clusters(endpoint: str, num_kv_blocks: int, threads: int | None) -> dict:
    from tests.integration.cluster import Cluster

    clusters = {}
    try:
        for config in CONFIGS:
            flags = service_flags(config, endpoint)
            log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"obs-overhead-{config}-"))
            worker_flags = [*flags, "--num-threads", str(threads)] if threads else flags
            clusters[config] = Cluster(log_dir, scheduler_args=flags, worker_args=worker_flags, gateway_args=flags,
                                       num_kv_blocks=num_kv_blocks)
            print(f"[{config}] starting cluster {' '.join(flags)} (logs {log_dir})", flush=True)
            for name in ("scheduler", "worker", "gateway"):
                clusters[config].start_service(name)
        for cluster in clusters.values():          # all three load at once; then each is waited for
            cluster.wait_ready(300)
    except BaseException:
        stop_clusters(clusters)
        raise
    return clusters


def stop_clusters(clusters: dict) -> None:
    for cluster in clusters.values():
        cluster.stop()


async def _load(base_url: str, reqs, concurrency: int, scrape_interval: float) -> tuple[dict, list[float]]:
    """The workload at `concurrency`; meanwhile /metrics every scrape_interval s (0 = never). Returns the bench
    summary and the scrape times (s)."""
    import aiohttp

    from steploop.bench.client import Target
    from steploop.bench.runner import run as bench_run
    from steploop.common.model_path import DEFAULT_MODEL

    scrapes: list[float] = []

    async def scraper() -> None:
        async with aiohttp.ClientSession(trust_env=False) as http:
            while True:
                await asyncio.sleep(scrape_interval)
                start = time.perf_counter()
                async with http.get(base_url + "/metrics") as resp:
                    await resp.read()
                scrapes.append(time.perf_counter() - start)

    task = asyncio.create_task(scraper()) if scrape_interval > 0 else None
    try:
        summary, _ = await bench_run(Target(base_url, DEFAULT_MODEL), reqs, max_concurrency=concurrency,
                                     progress=False)
    finally:
        if task is not None:
            task.cancel()
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary.get('errors')}")
    return summary, scrapes


def cpu_seconds(cluster) -> dict[str, float]:
    """CPU time (user + system) each service process has used so far, from /proc/PID/stat. On a shared 2-core
    machine wall-clock throughput swings by +-10% between identical runs; CPU time per token hardly does, and
    metrics or tracing cost CPU time, so it is the finer measure of what they cost."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, proc in cluster.procs.items():
        try:
            fields = pathlib.Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick     # utime, stime (fields 14, 15 of stat)
    return out


def metric_samples(base_url: str) -> int:
    """Samples in one /metrics scrape of the gateway (its own and the engine's)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def verdict(ratio: dict) -> str:
    """'met' / 'not met' when every round agrees to within the target (per-round ratios no wider than
    1 +- TARGET_COST), else 'unresolved': the machine's noise is larger than the effect looked for."""
    if ratio["max"] - ratio["min"] > 2 * TARGET_COST:
        return (f"unresolved: per-round ratios {ratio['min']:.3f}-{ratio['max']:.3f} are wider than "
                f"+-{TARGET_COST:.0%} (median {ratio['median']:.3f}); rerun on a quieter machine or with more --rounds")
    return "met" if ratio["median"] >= 1 - TARGET_COST else "not met"


def measure(args: argparse.Namespace, tok, sink: SpanSink):
    """The three clusters up, warmed, then the interleaved rounds; every cluster stopped at the end."""
    from steploop.bench import datasets

    began = time.perf_counter()
    print(f"OTLP collector on {sink.endpoint}", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    scrapes: dict[str, list[float]] = {c: [] for c in CONFIGS}
    drains: list[float] = []
    clusters = start_clusters(sink.endpoint, args.num_kv_blocks, args.threads)
    try:
        started = time.perf_counter() - began
        print(f"clusters ready in {started:.0f} s", flush=True)
        warm = datasets.random_dataset(args.concurrency, args.prompt_len, 8, 0.0, tok, seed=99, as_ids=True)
        for config in CONFIGS:            # every batch size once, unmeasured
            asyncio.run(_load(clusters[config].base_url, warm, args.concurrency, 0))
        expected = SPANS_PER_REQUEST * len(warm)
        drains.append(sink.wait_for(expected, args.drain_timeout))
        for r in range(args.rounds):
            reqs = datasets.random_dataset(args.requests, args.prompt_len, args.output_len, 0.0, tok,
                                           seed=1000 + r, as_ids=True)
            for config in CONFIGS[r % 3:] + CONFIGS[:r % 3]:
                time.sleep(args.pause)
                interval = args.scrape_interval if config != "off" else 0
                cpu_before = cpu_seconds(clusters[config])
                summary, took = asyncio.run(_load(clusters[config].base_url, reqs, args.concurrency, interval))
                cpu_after = cpu_seconds(clusters[config])
                if summary["total_output_tokens"] != args.requests * args.output_len:
                    raise RuntimeError(f"{config}: {summary['total_output_tokens']} output tokens, expected "
                                       f"{args.requests * args.output_len} (ignore_eos not honoured?)")
                if config == "tracing":       # its spans reach the collector before the next run starts
                    expected += SPANS_PER_REQUEST * args.requests
                    drains.append(sink.wait_for(expected, args.drain_timeout))
                    cpu_after = cpu_seconds(clusters[config])      # exporting is part of tracing's cost
                tokens = summary["total_output_tokens"]
                cpu_ms = {k: 1e3 * (cpu_after[k] - cpu_before[k]) / tokens for k in cpu_after if k in cpu_before}
                scrapes[config] += took
                runs[config].append({"round": r, "output_throughput": summary["output_throughput"],
                                     "duration": summary["duration"], "median_ttft_ms": summary["median_ttft_ms"],
                                     "median_tpot_ms": summary["median_tpot_ms"],
                                     "cpu_ms_per_token": {**cpu_ms, "total": sum(cpu_ms.values())}})
                print(f"round {r + 1}/{args.rounds} {config:8s} {summary['output_throughput']:7.1f} tok/s "
                      f"({summary['duration']:.1f} s, {len(took)} scrapes), CPU {sum(cpu_ms.values()):.2f} ms/token "
                      f"({', '.join(f'{k} {v:.2f}' for k, v in cpu_ms.items())})", flush=True)
        samples = {config: metric_samples(clusters[config].base_url) for config in CONFIGS}
    finally:
        stop_clusters(clusters)          # SIGTERM: each service flushes its last spans at exit
    sink.wait_for(expected, args.drain_timeout)
    return runs, scrapes, drains, samples, started, expected


def run_e2e(args: argparse.Namespace) -> dict:
    from steploop.bench import datasets

    began = time.perf_counter()
    load_start = os.getloadavg()
    tok = datasets.load_tokenizer(None)
    sink = SpanSink()
    try:
        runs, scrapes, drains, samples, started, expected = measure(args, tok, sink)
    finally:
        sink.stop()

    tput = {c: [run["output_throughput"] for run in runs[c]] for c in CONFIGS}
    by_round = {c: {run["round"]: run["output_throughput"] for run in runs[c]} for c in CONFIGS}

    def ratio(on: str, off: str) -> dict:
        per_round = [by_round[on][r] / by_round[off][r] for r in range(args.rounds)]
        med = statistics.median(tput[on]) / statistics.median(tput[off])
        return {**spread(per_round), "per_round": per_round, "ratio_of_medians": med}

    ratios = {"metrics_vs_off": ratio("metrics", "off"), "tracing_vs_off": ratio("tracing", "off"),
              "tracing_vs_metrics": ratio("tracing", "metrics")}
    cpu = {c: [run["cpu_ms_per_token"]["total"] for run in runs[c]] for c in CONFIGS}
    cpu_by_round = {c: {run["round"]: run["cpu_ms_per_token"]["total"] for run in runs[c]} for c in CONFIGS}

    def cpu_ratio(on: str, off: str) -> dict:
        per_round = [cpu_by_round[on][r] / cpu_by_round[off][r] for r in range(args.rounds)]
        return {**spread(per_round), "per_round": per_round,
                "ratio_of_medians": statistics.median(cpu[on]) / statistics.median(cpu[off])}

    cpu_ratios = {"metrics_vs_off": cpu_ratio("metrics", "off"), "tracing_vs_off": cpu_ratio("tracing", "off")}
    per_service = {c: {k: statistics.median(run["cpu_ms_per_token"][k] for run in runs[c])
                       for k in runs[c][0]["cpu_ms_per_token"]} for c in CONFIGS}
    cost = {"metrics": 1 - ratios["metrics_vs_off"]["median"],
            "metrics_and_tracing": 1 - ratios["tracing_vs_off"]["median"],
            "tracing_over_metrics": 1 - ratios["tracing_vs_metrics"]["median"]}
    off_runs = tput["off"]
    return {
        "machine": {"cores": os.cpu_count(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
                    "wall_seconds": time.perf_counter() - began, "cluster_start_seconds": started,
                    "quick": args.quick},
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "concurrency": args.concurrency, "rounds": args.rounds, "greedy": True, "ignore_eos": True,
                     "worker_threads": args.threads or "all cores",
                     "prompts": "random token ids, fresh each round, the same for the three configurations",
                     "scrape_interval_s": args.scrape_interval, "order": "rotated each round"},
        "configs": {"off": "--disable-log-stats on gateway, scheduler and worker: no metric recorded, no "
                           "per-request or stats log line, no span; not scraped",
                    "metrics": "defaults: metrics recorded in all three services, the scheduler's per-request and "
                               "stats log lines, tracing off; gateway /metrics scraped every scrape_interval_s",
                    "tracing": "as metrics, plus --otlp-traces-endpoint on all three services to an in-process "
                               "OTLP/gRPC collector (BatchSpanProcessor, real export)"},
        "output_throughput": {c: {**spread(tput[c]), "runs": tput[c]} for c in CONFIGS},
        "runs": runs,
        "ratios": ratios,
        "cost": cost,
        "cpu_ms_per_token": {"median_by_service": per_service, "ratios": cpu_ratios,
                             "outside_forward": outside_forward_cost(per_service),
                             "cost": {"metrics": cpu_ratios["metrics_vs_off"]["median"] - 1,
                                      "metrics_and_tracing": cpu_ratios["tracing_vs_off"]["median"] - 1}},
        "target": f"cost <= {TARGET_COST:.0%} of output-token throughput",
        "verdict": {"metrics": verdict(ratios["metrics_vs_off"]),
                    "metrics_and_tracing": verdict(ratios["tracing_vs_off"])},
        "noise_off_runs_spread": (max(off_runs) - min(off_runs)) / statistics.median(off_runs),
        "spans": {"received": sink.total, "expected": expected, "per_request": SPANS_PER_REQUEST,
                  "by_service": dict(sink.by_service), "health_check_spans": sink.health, "exports": sink.exports,
                  "max_drain_wait_s": max(drains)},
        "scrapes": {c: {"count": len(s), "median_ms": statistics.median(s) * 1e3 if s else None}
                    for c, s in scrapes.items()},
        "metric_samples_at_end": samples,
    }


# ---- 2. scheduler-only loop ---------------------------------------------------------------------------------------
def loop_run(num_requests: int, prompt_len: int, max_tokens: int, observe: bool):
    from benchmarks.scheduler_step import BenchWorker
    from steploop.common.sampling_params import SamplingParams
    from steploop.common.step_contract import WorkerInfo
    from steploop.scheduler.async_scheduler import make_scheduler
    from steploop.scheduler.config import SchedulerConfig
    from steploop.scheduler.kv_cache_manager import KVCacheManager
    from steploop.scheduler.metrics import EngineObserver
    from steploop.scheduler.request import Request
    from steploop.scheduler.stats import LoadReport, StepStats

    kv = KVCacheManager(num_requests * ((prompt_len + max_tokens) // 16 + 2) + 1, 16)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=num_requests), kv, 4096, [2])
    obs = EngineObserver(lambda: LoadReport(num_running=sched.num_running, num_waiting=sched.num_waiting,
                                            counters=sched.counters()), enable_prefix_caching=True)
    obs.on_attach(WorkerInfo(worker_id="bench", model_name="bench-model", block_size=16, num_kv_blocks=kv.num_blocks,
                             max_model_len=4096, vocab_size=32000, eos_token_ids=(2,)))
    worker, steps = BenchWorker(), 0
    start = time.perf_counter()
    for i in range(num_requests):
        request = Request(f"r{i}", [10 + (i * 7 + j) % 30000 for j in range(prompt_len)],
                          sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        sched.add_request(request)
        if observe:
            obs.on_arrival(request)
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if observe:
            obs.on_plan(plan, sched.new_request_ids(plan))
        result = worker.execute(plan)
        outputs = sched.update_from_output(plan, result)
        if observe:
            obs.on_step(StepStats(plan.step_id, plan.total_num_scheduled_tokens, result.forward_seconds, 0,
                                  outputs))
        steps += 1
    return time.perf_counter() - start, steps, obs


def run_scheduler_only(args: argparse.Namespace) -> dict:
    from opentelemetry.sdk.trace import TracerProvider

    from steploop.common import metrics, tracing

    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    logging.basicConfig(level=logging.INFO, stream=io.StringIO(), force=True)   # log lines formatted, not printed
    provider = TracerProvider()                     # no span processor: spans are built, then dropped
    times: dict[str, list[float]] = {"off": [], "metrics": [], "tracing": []}
    steps, obs = 0, None
    try:
        for _ in range(args.loop_repeats):
            for variant in list(times):
                if variant == "tracing":
                    tracing.enable(provider)
                seconds, steps, obs = loop_run(args.loop_requests, args.loop_prompt_len, args.loop_max_tokens,
                                               variant != "off")
                tracing.disable()
                times[variant].append(seconds)
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    scrape_start = time.perf_counter()
    body = metrics.exposition(obs.registry)
    scrape_ms = (time.perf_counter() - scrape_start) * 1e3
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"requests": args.loop_requests, "prompt_len": args.loop_prompt_len, "max_tokens": args.loop_max_tokens,
           "repeats": args.loop_repeats, "steps": steps,
           "us_per_step": {k: v / steps * 1e6 for k, v in med.items()},
           "ratio_metrics_vs_off": med["metrics"] / med["off"], "ratio_tracing_vs_off": med["tracing"] / med["off"],
           "added_us_per_step_metrics": (med["metrics"] - med["off"]) / steps * 1e6,
           "added_us_per_step_tracing": (med["tracing"] - med["off"]) / steps * 1e6,
           "scrape_ms": scrape_ms, "scrape_bytes": len(body)}
    step_us = med["off"] / steps * 1e6 + args.forward_ms * 1e3
    out["estimated_cost_with_forward"] = {"forward_ms": args.forward_ms,
                                          "metrics": out["added_us_per_step_metrics"] / step_us,
                                          "tracing": out["added_us_per_step_tracing"] / step_us}
    return out


# ---- main -------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke version (~2 min on a quiet machine): 3 rounds of a smaller workload, a shorter loop")
    parser.add_argument("--only", choices=("e2e", "loop"), help="run one section; the other is kept from the file")
    parser.add_argument("--out", default=str(RESULTS), help="results file")
    e2e = parser.add_argument_group("end to end")
    e2e.add_argument("--rounds", type=int, default=None, help="rounds of off/metrics/tracing (default 5; quick 3)")
    e2e.add_argument("--requests", type=int, default=None, help="requests per run (default 32; quick 16)")
    e2e.add_argument("--prompt-len", type=int, default=32)
    e2e.add_argument("--output-len", type=int, default=None, help="tokens generated per request (default 48; quick 32)")
    e2e.add_argument("--concurrency", type=int, default=16)
    e2e.add_argument("--scrape-interval", type=float, default=5.0,
                     help="seconds between /metrics scrapes during metrics and tracing runs (0 = none)")
    e2e.add_argument("--pause", type=float, default=1.0, help="seconds of quiet before each run")
    e2e.add_argument("--drain-timeout", type=float, default=15.0,
                     help="most seconds to wait for a tracing run's spans to reach the collector")
    e2e.add_argument("--num-kv-blocks", type=int, default=640)
    e2e.add_argument("--threads", type=int, default=None,
                     help="the workers' torch threads (--num-threads); default: all cores, as a plain cluster")
    loop = parser.add_argument_group("scheduler-only loop")
    loop.add_argument("--loop-requests", type=int, default=None, help="default 256; quick 64")
    loop.add_argument("--loop-prompt-len", type=int, default=64)
    loop.add_argument("--loop-max-tokens", type=int, default=128)
    loop.add_argument("--loop-repeats", type=int, default=None, help="default 5; quick 3")
    loop.add_argument("--forward-ms", type=float, default=10.0,
                      help="a real step's forward time, for the loop's estimated throughput cost in serving")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for name, full, quick in (("rounds", 5, 3), ("requests", 32, 16), ("output_len", 48, 32),
                              ("loop_requests", 256, 64), ("loop_repeats", 5, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))        # so clusters are stopped in finally blocks
    out_path = pathlib.Path(args.out)
    doc = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if "us_per_step" in doc:                                       # the old file: the loop section alone
        doc = {"scheduler_only": doc}
    if args.only != "e2e":
        doc["scheduler_only"] = run_scheduler_only(args)
        print(json.dumps({"scheduler_only": doc["scheduler_only"]}, indent=2), flush=True)
    if args.only != "loop":
        doc["e2e"] = run_e2e(args)
    doc = {k: doc[k] for k in ("e2e", "scheduler_only") if k in doc}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    if "e2e" in doc and args.only != "loop":
        print_summary(doc["e2e"])
    print(f"results in {out_path}")


def outside_forward_cost(per_service: dict) -> dict:
    """The worker's CPU time is its forward pass (two threads, busy or spinning), which swings with the machine's
    load by far more than 2%; the gateway's and scheduler's are where per-request and per-token metrics and spans
    are recorded. Their extra CPU ms per token over `off`, as a share of all CPU ms per token with `off`."""
    def outside(config: str) -> float:
        return per_service[config].get("gateway", 0.0) + per_service[config].get("scheduler", 0.0)

    base = per_service["off"]["total"]
    return {config: {"extra_ms_per_token": outside(config) - outside("off"),
                     "share_of_total": (outside(config) - outside("off")) / base}
            for config in ("metrics", "tracing")}


def print_summary(e2e: dict) -> None:
    print("\noutput tok/s, median [min-max] over", e2e["workload"]["rounds"], "rounds:")
    for config, t in e2e["output_throughput"].items():
        print(f"  {config:8s} {t['median']:7.1f} [{t['min']:.1f}-{t['max']:.1f}]")
    for name, r in e2e["ratios"].items():
        print(f"  {name:20s} {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]  (ratio of medians "
              f"{r['ratio_of_medians']:.3f})")
    print("  cost:", ", ".join(f"{k} {v:+.1%}" for k, v in e2e["cost"].items()),
          f"(target <= {TARGET_COST:.0%}; off runs spread {e2e['noise_off_runs_spread']:.1%})")
    for name, text in e2e["verdict"].items():
        print(f"  {name}: {text}")
    c = e2e["cpu_ms_per_token"]
    print("CPU ms per output token (all three services), median by service:")
    for config, by in c["median_by_service"].items():
        print(f"  {config:8s} " + ", ".join(f"{k} {v:.2f}" for k, v in by.items()))
    for name, r in c["ratios"].items():
        print(f"  {name:20s} {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]")
    print("  CPU cost:", ", ".join(f"{k} {v:+.1%}" for k, v in c["cost"].items()))
    print("  gateway + scheduler CPU added per token:", ", ".join(
        f"{k} {v['extra_ms_per_token']:+.3f} ms ({v['share_of_total']:+.2%} of all CPU per token)"
        for k, v in c["outside_forward"].items()))
    s = e2e["spans"]
    print(f"  spans received {s['received']} of {s['expected']} expected, {s['exports']} exports, "
          f"{s['by_service']}")


if __name__ == "__main__":
    main()
