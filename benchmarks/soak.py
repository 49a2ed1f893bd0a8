"""The soak scenario of tests/integration/test_soak.py, run longer: python -m benchmarks.soak [--minutes 5]

Starts a cluster with a small KV pool (preemption pressure), runs N client loops that abort at random and read
slowly, then reports requests served, aborted, rejected, errors, peak memory per service and KV blocks leaked.
Writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile

from tests.integration.cluster import Cluster
from tests.integration.soak import SoakSettings, run_soak

RESULTS = pathlib.Path(__file__).parent / "results" / "soak.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        cluster = Cluster(pathlib.Path(logs), worker_args=["--max-model-len", "512"], num_kv_blocks=args.num_kv_blocks,
                          scheduler_args=["--max-num-seqs", str(args.concurrency)])
        try:
            cluster.start()
            report = asyncio.run(run_soak(cluster, SoakSettings(duration_s=args.minutes * 60,
                                                                concurrency=args.concurrency)))
            preemptions = (pathlib.Path(logs) / "scheduler.log").read_text().count("; it will be recomputed")
        finally:
            cluster.stop()
    result = {"minutes": args.minutes, "concurrency": args.concurrency, "num_kv_blocks": args.num_kv_blocks,
              "requests_started": report.started, "completed": report.completed,
              "aborted_by_client": report.aborted_by_client, "rejected": report.rejected,
              "errors": report.errors[:20], "num_errors": len(report.errors), "output_chunks": report.output_tokens,
              "preemptions_logged": preemptions, "rss_mb_at_end": report.rss_mb, "peak_rss_mb": report.peak_rss_mb, "rss_growth_mb": report.rss_growth_mb,
              "blocks_leaked": report.total_blocks - 1 - report.free_blocks_at_idle}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
