"""What metrics, request logs and tracing cost the step loop:  python -m benchmarks.observability_overhead

Drives the real Scheduler with a fake worker (no gRPC, no forward: the worst case, where the scheduler is all
the work there is) and calls the EngineObserver hooks exactly where EngineLoop does. Three variants, run
interleaved several times, median of each:

  off      no observer hooks at all
  metrics  the hooks (vllm:*/steploop:* metrics + one INFO log line per finished request, formatted)
  tracing  the hooks with tracing on (SDK provider, spans dropped by a no-op exporter)

Reports time per step and the ratio (scheduler-only: the worst case), the added microseconds per step, that
cost as a share of a serving step with a forward of --forward-ms (an estimate), and one /metrics scrape's cost.
Writes benchmarks/results/observability_overhead.json. Target: metrics cost <= 2% of throughput.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import statistics
import time
from pathlib import Path

from benchmarks.scheduler_step import BenchWorker
from services.common import metrics, tracing
from services.common.sampling_params import SamplingParams
from services.common.step_contract import WorkerInfo
from services.scheduler.async_scheduler import make_scheduler
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.metrics import EngineObserver
from services.scheduler.request import Request

RESULTS = Path(__file__).parent / "results" / "observability_overhead.json"


class LoopStub:
    """The parts of EngineLoop the observer reads."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.link, self._pending = scheduler, None, []
        self.worker_info = WorkerInfo(worker_id="bench", model_name="bench-model", block_size=16,
                                      num_kv_blocks=scheduler.kv.pool.num_blocks, max_model_len=4096,
                                      vocab_size=32000, eos_token_ids=(2,))


def run(num_requests: int, prompt_len: int, max_tokens: int, observe: bool) -> tuple[float, int, EngineObserver]:
    kv = KVCacheManager(num_requests * ((prompt_len + max_tokens) // 16 + 2) + 1, 16)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=num_requests), kv, 4096, [2])
    loop = LoopStub(sched)
    obs = EngineObserver(loop)
    obs.on_attach()
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
            obs.on_plan(plan)
        result = worker.execute(plan)
        outputs = sched.update_from_output(plan, result)
        if observe:
            obs.on_step(plan, result, outputs)
        steps += 1
    return time.perf_counter() - start, steps, obs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--forward-ms", type=float, default=10.0,
                        help="a real step's forward time, for the estimated throughput cost in serving")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=io.StringIO())   # log lines formatted, not printed

    from opentelemetry.sdk.trace import TracerProvider
    provider = TracerProvider()                     # no span processor: spans are built, then dropped
    times: dict[str, list[float]] = {"off": [], "metrics": [], "tracing": []}
    steps = 0
    for _ in range(args.repeats):
        for variant in list(times):
            if variant == "tracing":
                tracing.enable(provider)
            seconds, steps, obs = run(args.requests, args.prompt_len, args.max_tokens, variant != "off")
            tracing.disable()
            times[variant].append(seconds)
    scrape_start = time.perf_counter()
    body = metrics.exposition(obs.registry)
    scrape_ms = (time.perf_counter() - scrape_start) * 1e3
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "steps": steps,
           "us_per_step": {k: v / steps * 1e6 for k, v in med.items()},
           "ratio_metrics_vs_off": med["metrics"] / med["off"], "ratio_tracing_vs_off": med["tracing"] / med["off"],
           "added_us_per_step_metrics": (med["metrics"] - med["off"]) / steps * 1e6,
           "added_us_per_step_tracing": (med["tracing"] - med["off"]) / steps * 1e6,
           "scrape_ms": scrape_ms, "scrape_bytes": len(body)}
    step_us = med["off"] / steps * 1e6 + args.forward_ms * 1e3
    out["estimated_cost_with_forward"] = {"forward_ms": args.forward_ms,
                                          "metrics": out["added_us_per_step_metrics"] / step_us,
                                          "tracing": out["added_us_per_step_tracing"] / step_us}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
