"""The scheduler's own cost per step, with a fake worker and no gRPC:  python -m benchmarks.scheduler_step

For 64 .. 4096 running requests, decode-only and mixed (new requests arriving, their prompts chunked into the
same steps), it times schedule() + update_from_output() per step (wall clock: median, p90; and this thread's CPU
time: median, min, which a busy shared machine inflates less) and measures the serialized size of
StepPlan.to_pb() per decode request. Each case runs with the scheduler's C loops for plain decodes (the default,
services/scheduler/fastpath) and then with its Python loops (`loops` column; the ratio is the gain). The process
runs with the scheduler service's GC settings (services/scheduler/gc_tuning.py; `--gc default` keeps CPython's,
for a comparison). Writes benchmarks/results/scheduler_step.json (with the load average the run saw) and prints
a table.
Targets: <= 1 ms per step at 1024 running decode requests, linear growth; <= 6 bytes per decode request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from steploop.common import envs
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler import gc_tuning
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request

RESULTS = Path(__file__).parent / "results" / "scheduler_step.json"
BLOCK_SIZE = 16
PROMPT_LEN = 256


class BenchWorker:
    """Just enough of a worker to answer plans: tracks tokens per handle and samples a constant token."""

    def __init__(self) -> None:
        self.held: dict[int, list[int]] = {}        # handle -> [num_tokens, num_computed]

    def execute(self, plan: StepPlan) -> StepResult:
        for handle in plan.finished_handles:
            self.held.pop(handle, None)
        for handle in plan.preempted_handles:
            self.held.pop(handle, None)
        for new in plan.new_requests:
            self.held[new.handle] = [len(new.prompt_token_ids) + len(new.output_token_ids), new.num_computed_tokens]
        sampled = {}
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            state = self.held[handle]
            state[1] += n
            if state[1] >= state[0]:
                state[0] += 1
                sampled[handle] = [17]
        # A timed step, GPU-like (10 ms + 10 us per token), so the prefill pacer fits its cost model and runs as in service.
        tokens = sum(plan.num_scheduled_tokens)
        return StepResult(step_id=plan.step_id, sampled=sampled, forward_seconds=0.01 + 1e-5 * tokens)


def _request(i: int, rng: random.Random, max_tokens: int) -> Request:
    prompt = [rng.randrange(10, 30000) for _ in range(PROMPT_LEN + rng.randrange(BLOCK_SIZE))]
    return Request(f"r{i}", prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=float(i))


def bench(num_running: int, mixed: bool, async_scheduling: bool, steps: int, c_loops: bool = True) -> dict:
    rng = random.Random(num_running)
    # Decode: a budget that admits every prompt in one step, so all num_running requests decode when measured
    # (with a small one, admission takes longer than the requests live). Mixed: prompts keep arriving.
    budget = num_running + 512 if mixed else num_running * (PROMPT_LEN + BLOCK_SIZE)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_running,
                             async_scheduling=async_scheduling)
    num_blocks = num_running * (PROMPT_LEN + 3 * steps) // BLOCK_SIZE + 64
    sched = make_scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, config.enable_prefix_caching), 4096, [2])
    if not c_loops:
        sched.c_loops = None
    elif sched.c_loops is None:
        raise SystemExit("the scheduler's C loops are not built (gcc and Python.h needed); see the warning above")
    worker, next_id = BenchWorker(), 0
    for _ in range(num_running):
        # Mixed: short outputs so requests keep finishing and new prompts keep arriving.
        sched.add_request(_request(next_id, rng, rng.randint(4, 40) if mixed else 2 * steps))
        next_id += 1
    plan, result = None, None
    # Admit everyone and finish their prompts before measuring (decode: until a step is one token per request).
    while sched.num_waiting or (not mixed and (plan is None or plan.total_num_scheduled_tokens != num_running)):
        plan = sched.schedule()
        sched.update_from_output(plan, worker.execute(plan))
    times, cpu_times, plan_bytes = [], [], []
    for _ in range(steps):
        while mixed and sched.num_running + sched.num_waiting < num_running:
            sched.add_request(_request(next_id, rng, rng.randint(4, 40)))
            next_id += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = sched.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        result = worker.execute(plan)
        t2, c2 = time.perf_counter(), time.thread_time()
        sched.update_from_output(plan, result)
        t3, c3 = time.perf_counter(), time.thread_time()
        times.append((t1 - t0) + (t3 - t2))
        cpu_times.append((c1 - c0) + (c3 - c2))
        if not mixed:
            plan_bytes.append(len(plan.to_pb().SerializeToString()) / max(len(plan.scheduled_handles), 1))
    times.sort()
    return {"num_running": num_running, "mixed": mixed, "async": async_scheduling, "steps": steps,
            "loops": "c" if c_loops else "python",
            "median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
            "us_per_request": 1e6 * statistics.median(times) / num_running,
            "cpu_median_ms": 1e3 * statistics.median(cpu_times), "cpu_min_ms": 1e3 * min(cpu_times),
            "bytes_per_decode_request": statistics.median(plan_bytes) if plan_bytes else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--gc", choices=["tuned", "default"], default="tuned",
                        help="tuned: the scheduler service's GC settings (the default); default: CPython's")
    args = parser.parse_args()
    if args.gc == "tuned" and not gc_tuning.tune():
        raise SystemExit(f"{envs.SCHEDULER_GC_TUNING}=0 is set: pass --gc default to run with CPython's settings")
    rows = [bench(n, mixed, asy, args.steps, c) for n in args.sizes for mixed in (False, True) for asy in (False, True)
            for c in (True, False)]
    load = os.getloadavg()[0]
    for r in rows:
        r["load_average_1m"], r["cpus"], r["gc"] = round(load, 2), os.cpu_count(), args.gc
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    print(f"{'running':>8} {'workload':>8} {'sched':>5} {'loops':>6} {'median ms':>10} {'p90 ms':>8} {'us/req':>7} "
          f"{'cpu ms':>7} {'cpu min':>7} {'B/decode':>9}")
    for r in rows:
        b = f"{r['bytes_per_decode_request']:.2f}" if r["bytes_per_decode_request"] is not None else "-"
        print(f"{r['num_running']:>8} {'mixed' if r['mixed'] else 'decode':>8} {'async' if r['async'] else 'sync':>5} "
              f"{r['loops']:>6} "
              f"{r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} {r['us_per_request']:>7.2f} {r['cpu_median_ms']:>7.3f} "
              f"{r['cpu_min_ms']:>7.3f} {b:>9}")
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs: on a busy machine read the CPU columns; gc {args.gc}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
