"""What tensor parallelism costs the scheduler, and what it does to throughput:  python -m benchmarks.tp_plan_cost

1. Plan fan-out, in process, no gRPC: a real Scheduler with 256 running decode requests drives a worker group of
   world size 1, 2 and 4 (a WorkerGroup of WorkerLinks over in-memory streams; a fake worker answers). Per step it
   times schedule() + send (serialize, write to every rank) + recv (every rank's answer) + update_from_output()
   in this thread's CPU time, and counts the plan bytes serialized. Target: <= 1.1x the world-size-1 cost.
2. --throughput: real clusters (gateway, scheduler, workers as processes) on the default model, 64 concurrent
   greedy completions of 64 tokens, `-tp 1` (its default kernel plan, then with torch linears as a TP rank runs
   them) and `-tp 3`: output tokens/s, and rank 0's time in collectives per step (from its log). On a 2-core
   machine -tp 3 is not expected to be faster, only correct.
Writes benchmarks/results/tp_plan_cost.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from pathlib import Path

from benchmarks.scheduler_step import BLOCK_SIZE, PROMPT_LEN, BenchWorker, _request
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.worker_group import GroupAssembler
from steploop.scheduler.worker_link import WorkerLink
from tests.tp.test_worker_group import FakeStream, info

RESULTS = Path(__file__).parent / "results" / "tp_plan_cost.json"


async def fan_out(world_size: int, num_running: int, steps: int) -> dict:
    rng = random.Random(num_running)
    config = SchedulerConfig(max_num_batched_tokens=num_running * (PROMPT_LEN + BLOCK_SIZE), max_num_seqs=num_running,
                             async_scheduling=False)
    blocks = num_running * (PROMPT_LEN + 3 * steps) // BLOCK_SIZE + 64
    sched = make_scheduler(config, KVCacheManager(blocks, BLOCK_SIZE, True), 4096, [2])
    for i in range(num_running):
        sched.add_request(_request(i, rng, 4 * steps))
    links = [WorkerLink(FakeStream(), info(r, world=world_size)) for r in range(world_size)]
    assembler = GroupAssembler(world_size, 30.0)       # world size 1: a group of one, as the scheduler drives it
    for link in links:
        target = assembler.add(link)
    worker = BenchWorker()
    cpu, plan_bytes = [], []
    for step in range(steps + 20):          # the first steps admit the prompts: not measured
        c0 = time.thread_time()
        plan = sched.schedule()
        before = target.bytes_sent
        await target.send(plan)
        c1 = time.thread_time()
        result = worker.execute(plan)       # the worker's part: not the scheduler's CPU
        c2 = time.thread_time()
        for r, link in enumerate(links):
            link._results.put_nowait((result if r == 0 else type(result)(step_id=plan.step_id)).to_pb())
        sched.update_from_output(plan, await target.recv(plan))
        c3 = time.thread_time()
        for link in links:
            link.context.written.clear()
        if step >= 20:
            cpu.append((c1 - c0) + (c3 - c2))
            plan_bytes.append(target.bytes_sent - before)
    return {"world_size": world_size, "num_running": num_running, "steps": steps,
            "cpu_median_ms": 1e3 * statistics.median(cpu), "cpu_min_ms": 1e3 * min(cpu),
            "plan_bytes_per_step": statistics.median(plan_bytes),
            "bytes_written_per_step": statistics.median(plan_bytes) * world_size}


def throughput(world_size: int, tmp: Path, requests: int = 64, max_tokens: int = 64,
               torch_linears: bool = False) -> dict:
    import openai

    from tests.integration.cluster import Cluster
    from tests.tp.tp_cluster import TpCluster

    log_dir = tmp / f"tp{world_size}{'-torch' if torch_linears else ''}-{int(time.time())}"
    log_dir.mkdir(parents=True)
    env = {"STEPLOOP_CPU_PACKED_WEIGHTS": "0"} if torch_linears else {}   # what a TP rank runs, at -tp 1
    cluster = (Cluster(log_dir, num_kv_blocks=2048, env=env) if world_size == 1
               else TpCluster(log_dir, world_size, num_kv_blocks=2048)).start()
    try:
        async def run() -> float:
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=900)
            prompts = [f"Write a short story about the number {i}." for i in range(requests)]
            started = time.perf_counter()
            outs = await asyncio.gather(*(client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=p, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True}) for p in prompts))
            seconds = time.perf_counter() - started
            await client.close()
            return sum(o.usage.completion_tokens for o in outs) / seconds
        tok_s = asyncio.run(run())
    finally:
        cluster.stop()
    row = {"world_size": world_size, "linears": "torch" if torch_linears or world_size > 1 else "default plan",
           "concurrent": requests, "max_tokens": max_tokens, "output_tok_s": round(tok_s, 1)}
    if world_size > 1:
        lines = re.findall(r"collectives ([\d.]+) ms/step of ([\d.]+) ms/step forward",
                           (log_dir / "worker-0.log").read_text())
        if lines:
            row["collective_ms_per_step"] = statistics.median(float(c) for c, _ in lines)
            row["forward_ms_per_step"] = statistics.median(float(f) for _, f in lines)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best median is kept")
    parser.add_argument("--throughput", action="store_true", help="also run the -tp 1 / -tp 3 clusters")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (--throughput)")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/tp_plan_cost"))
    args = parser.parse_args()
    rounds = [[asyncio.run(fan_out(ws, args.num_running, args.steps)) for ws in (1, 2, 4)]
              for _ in range(args.rounds)]          # interleaved, so load drift hits every size alike
    fan = [min(runs, key=lambda r: r["cpu_median_ms"]) for runs in zip(*rounds)]
    for row in fan:       # the min is the step least disturbed by a busy machine: the fairer ratio there
        row["cpu_vs_ws1"] = round(row["cpu_median_ms"] / fan[0]["cpu_median_ms"], 3)
        row["cpu_min_vs_ws1"] = round(row["cpu_min_ms"] / fan[0]["cpu_min_ms"], 3)
    report = {"fan_out": fan, "load_average_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    print(f"{'ws':>3} {'running':>8} {'cpu ms/step':>12} {'x ws1':>6} {'cpu min':>8} {'x ws1':>6} "
          f"{'plan B/step':>12} {'written B/step':>15}")
    for r in fan:
        print(f"{r['world_size']:>3} {r['num_running']:>8} {r['cpu_median_ms']:>12.3f} {r['cpu_vs_ws1']:>6.3f} "
              f"{r['cpu_min_ms']:>8.3f} {r['cpu_min_vs_ws1']:>6.3f} {r['plan_bytes_per_step']:>12.0f} "
              f"{r['bytes_written_per_step']:>15.0f}")
    if args.throughput:
        report["throughput"] = [throughput(ws, args.tmp, max_tokens=args.max_tokens, torch_linears=torch)
                                for ws, torch in ((1, False), (1, True), (3, False))]
        for r in report["throughput"]:
            print(f"-tp {r['world_size']} ({r['linears']} linears): {r['output_tok_s']} output tok/s at "
                  f"{r['concurrent']} concurrent"
                  + (f"; collectives {r['collective_ms_per_step']:.2f} ms of {r['forward_ms_per_step']:.2f} ms "
                     f"per step (rank 0)" if "collective_ms_per_step" in r else ""))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"load average {report['load_average_1m']} on {report['cpus']} CPUs; wrote {RESULTS}")


if __name__ == "__main__":
    main()
