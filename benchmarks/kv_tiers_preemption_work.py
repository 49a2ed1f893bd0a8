"""Preemption-heavy loads, the work counted (no model): the real Scheduler with tiers off (recompute, prefix caching
on) and on (swap to host memory), a worker that only answers plans. Per workload: preemptions, prompt tokens
computed (first prompts + recomputed), decode-only steps, and per resume of a preempted request the tokens of its
context that the pool still held, that were restored from host memory, and that were recomputed. The schedule does
not depend on timings here except through prefill pacing, so these are the counts a real run makes.

    python -m benchmarks.kv_tiers_preemption_work [--measure-rounds 2]

The total-time ratio off/on follows from two unit costs measured on the real runner (`unit_costs`: a decode-only
step of 2 requests at ~1k context, a prompt token in 512-token chunks, alternating): off/on = (D*d + P_off*p) /
(D*d + P_on*p), with D decode-only steps (the same in both modes) and P prompt tokens. Also: the ceiling if decode
steps cost nothing (P_off / P_on), and the prompt-token cost, in decode steps, that a 1.5x would need
(0.5 D / (P_off - 1.5 P_on); none when P_off < 1.5 P_on).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import time

from benchmarks.scheduler_step import BenchWorker
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.kv_tiers import KvTiers
from steploop.scheduler.request import Request

BLOCK = 16
# (requests, prompt, output, pool in full sequences): the "pool of one or two full sequences", 2k-4k tokens.
WORKLOADS = [(4, 2048, 768, 1.5), (4, 512, 1536, 1.0), (8, 512, 1536, 1.0), (8, 256, 1792, 1.0),
             (4, 512, 1536, 2.0), (8, 512, 1536, 2.0), (8, 1024, 1792, 2.0)]


def count(tiers: bool, n: int, prompt: int, output: int, pool_seqs: float, x: float) -> dict:
    """The work of one run; its clock in decode steps: a step costs 1 + x per prompt token it computes."""
    seq = prompt + output
    blocks = int(pool_seqs * seq) // BLOCK + 1                      # + the null block
    kv = KVCacheManager(blocks, BLOCK, True)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=n), kv, (blocks - 1) * BLOCK,
                           [2])
    restored: dict[str, int] = {}
    if tiers:                                                      # host memory for 2 sequences, as kv_tiers.py
        kv.attach_tiers(KvTiers(2 * seq // BLOCK, 0, 1))
        record = kv.tiers.record_admission

        def record_admission(request_id, num_tokens, num_pool_hit, num_restored, block_size):
            restored[request_id] = num_restored
            record(request_id, num_tokens, num_pool_hit, num_restored, block_size)
        kv.tiers.record_admission = record_admission
    rng = random.Random(2)
    for i in range(n):
        sched.add_request(Request(f"p{i}", [rng.randrange(100, 40000) for _ in range(prompt)],
                                  sampling=SamplingParams(max_tokens=output, ignore_eos=True)))
    worker = BenchWorker()
    prompt_tokens = decode_steps = context = pool_hit = restored_tokens = resumes = 0
    clock, ttft = 0.0, {}
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        for new in plan.new_requests:
            r = sched.handles.by_handle[new.handle]
            if r.num_preemptions:
                got = restored.get(r.request_id, 0)
                resumes, context = resumes + 1, context + r.num_tokens
                pool_hit, restored_tokens = pool_hit + new.num_computed_tokens - got, restored_tokens + got
        prompt = sum(k for k in plan.num_scheduled_tokens if k > 1)
        prompt_tokens += prompt
        decode_steps += not prompt
        clock += 1 + x * prompt
        for out in sched.update_from_output(plan, worker.execute(plan)):
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = clock
    ts = sorted(ttft.values())
    return {"preemptions": sched.num_preemptions, "prompt_tokens": prompt_tokens, "decode_only_steps": decode_steps,
            "resumes": resumes, "resumed_context_tokens": context, "resumed_pool_hit_tokens": pool_hit,
            "resumed_restored_tokens": restored_tokens,
            "resumed_recomputed_tokens": context - pool_hit - restored_tokens,
            "modelled_total_steps": clock, "modelled_p99_ttft_steps": ts[min(len(ts) - 1, int(0.99 * len(ts)))]}


def swap_cost(runner, blocks: int) -> dict:
    """Seconds to swap a context of `blocks` blocks out to host memory and back in (the worker's KvTierMover)."""
    from steploop.common.kv_moves import KvMoves
    from steploop.gpu_worker.kv_tier_mover import KvTierMover

    mover = KvTierMover(runner.kv_caches, blocks)
    out, back = KvMoves(), KvMoves()
    out.stores.extend((1 + i, i) for i in range(blocks))
    back.loads.extend((i, 1 + blocks + i) for i in range(blocks))
    return {"swap_blocks": blocks, "swap_out_s": mover.apply(out).seconds, "swap_in_s": mover.apply(back).seconds}


def unit_costs(rounds: int) -> list[dict]:
    """Seconds of a decode-only step and of a prompt token on the real runner (CPU, the default model), and of a
    2048-token context's swap out and in, per round."""
    from benchmarks.kv_tiers import build_runner, greedy, rand_tokens, scheduler
    from steploop.common.model_path import default_model_dir

    runner = build_runner(default_model_dir(), 2 * 2048 // BLOCK + 2, host_gib=0.01, disk="")
    rng, out = random.Random(7), []
    for r in range(rounds):
        out.append(swap_cost(runner, 2048 // BLOCK))
        sched = scheduler(runner, False, max_num_seqs=4)
        for i in range(2):
            sched.add_request(Request(f"r{r}.{i}", rand_tokens(rng, 1024), sampling=greedy(24)))
        decode, prompt_s, prompt_tokens, load = [], 0.0, 0, os.getloadavg()[0]
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            start = time.perf_counter()
            result = runner.execute(plan)
            seconds = time.perf_counter() - start
            if max(plan.num_scheduled_tokens, default=0) > 1:
                prompt_s += seconds
                prompt_tokens += sum(k for k in plan.num_scheduled_tokens if k > 1)
            else:
                decode.append(seconds)
            sched.update_from_output(plan, result)
        out[-1].update(decode_step_s=statistics.median(decode), prompt_token_s=prompt_s / prompt_tokens,
                       load_1m_start=load, load_1m_end=os.getloadavg()[0])
        print("unit costs", json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-rounds", type=int, default=2, help="rounds of the unit-cost measurement")
    parser.add_argument("--out", default="benchmarks/results/kv_tiers_preemption_work.json")
    args = parser.parse_args()
    costs = unit_costs(args.measure_rounds)
    x = statistics.median(c["prompt_token_s"] / c["decode_step_s"] for c in costs)   # a prompt token, in steps
    out = {"unit_costs": costs, "prompt_token_in_decode_steps": x, "workloads": []}
    for n, prompt, output, pool in WORKLOADS:
        off, on = count(False, n, prompt, output, pool, x), count(True, n, prompt, output, pool, x)
        d = on["decode_only_steps"]
        ratio = (off["decode_only_steps"] + x * off["prompt_tokens"]) / (d + x * on["prompt_tokens"])
        # x at which (D + x*P_off) = 1.5 (D + x*P_on): the prompt-token cost a 1.5x would need
        room = off["prompt_tokens"] - 1.5 * on["prompt_tokens"]
        row = {"requests": n, "prompt": prompt, "output": output, "pool_sequences": pool, "off": off, "on": on,
               "predicted_total_off_over_on": ratio,
               "predicted_p99_ttft_off_over_on": off["modelled_p99_ttft_steps"] / on["modelled_p99_ttft_steps"],
               "ceiling_if_decode_steps_were_free": off["prompt_tokens"] / on["prompt_tokens"],
               "prompt_token_cost_for_1_5x_in_decode_steps": 0.5 * d / room if room > 0 else None}
        out["workloads"].append(row)
        print(json.dumps(row), flush=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
