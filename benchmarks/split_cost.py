"""What serving a token costs around the model, in CPU:  python -m benchmarks.split_cost [--rounds N]

(b) in compare.py asks what the split into services costs next to the same engine in one process. On two cores the
worker's forward keeps both busy, so every CPU-second the gateway, the scheduler, the worker's gRPC side and the
load generator spend comes out of the forward's time; but one round's TPOT there moves 5-17 ms with the machine,
ten times what is asked of it. This measures that CPU directly, without a model: the real gateway and scheduler
processes and the real worker server around a runner that sleeps each step (benchmarks/paced_worker.py), driven by
the real bench client over HTTP (streamed completions, token-id prompts, ignore_eos), as compare.py's (b) drives the
cluster. CPU time per output token is steady from run to run where wall-clock time is not.

Reports, per round, microseconds of CPU per output token for gateway, scheduler, worker (its gRPC side only) and
the client, and what those add to a step of `--concurrency` decodes (the share of two cores they take away from a
forward). Writes benchmarks/results/split_cost.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

from benchmarks.observability_overhead import cpu_seconds
from steploop.bench import datasets
from steploop.bench.client import Target
from steploop.bench.runner import run as bench_run
from steploop.bench.runner import run_sync
from steploop.common.model_path import DEFAULT_MODEL
from tests.integration.cluster import Cluster

RESULTS = pathlib.Path(__file__).parent / "results" / "split_cost.json"
SERVICES = ("gateway", "scheduler", "worker")


def one_round(cluster: Cluster, reqs, concurrency: int) -> dict:
    before, client_before, wall = cpu_seconds(cluster), time.process_time(), time.perf_counter()
    summary, _ = run_sync(bench_run(Target(cluster.base_url, DEFAULT_MODEL), reqs, max_concurrency=concurrency,
                                    progress=False))
    after, client, wall = cpu_seconds(cluster), time.process_time() - client_before, time.perf_counter() - wall
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary.get('errors')}")
    tokens = summary["total_output_tokens"]
    us = {name: (after[name] - before[name]) / tokens * 1e6 for name in SERVICES}
    us["client"] = client / tokens * 1e6
    return {"output_tokens": tokens, "wall_s": wall, "output_throughput": summary["output_throughput"],
            "mean_tpot_ms": summary["mean_tpot_ms"], "us_per_token": us,
            "us_per_token_services": sum(us[name] for name in SERVICES)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=100.0, help="the paced worker's step time")
    parser.add_argument("--label", default="", help="stored with the results (e.g. the commit measured)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    tok = datasets.load_tokenizer(None)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="split-cost-"))
    cluster = Cluster(log_dir, worker_args=["--step-ms", str(args.step_ms)], num_kv_blocks=8192,
                      modules={"worker": "benchmarks.paced_worker"})
    rounds = []
    try:
        cluster.start(timeout=120)
        run_sync(bench_run(Target(cluster.base_url, DEFAULT_MODEL),
                           datasets.random_dataset(8, args.input_len, 8, 0.0, tok, seed=99, as_ids=True),
                           max_concurrency=8, progress=False))   # warm-up: connections, first-call paths
        for i in range(args.rounds):
            reqs = datasets.random_dataset(args.requests, args.input_len, args.output_len, 0.0, tok, seed=i,
                                           as_ids=True)
            rounds.append(one_round(cluster, reqs, args.concurrency))
            us = rounds[-1]["us_per_token"]
            print(f"round {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items())
                  + f" us/token; {rounds[-1]['output_throughput']:.0f} tok/s", flush=True)
    finally:
        cluster.stop()
    median = {k: statistics.median(r["us_per_token"][k] for r in rounds) for k in rounds[0]["us_per_token"]}
    around = sum(median.values())
    # In a step of `concurrency` decodes that takes step_ms on two busy cores, the work around the model takes
    # concurrency x around us of the cores' 2 x step_ms.
    doc = {"label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args), "rounds": rounds,
           "median_us_per_token": median, "median_us_per_token_all": around,
           "share_of_two_cores_per_step": args.concurrency * around / (2 * args.step_ms * 1000)}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("median_us_per_token", "median_us_per_token_all",
                                          "share_of_two_cores_per_step")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
