"""Pipeline stages overlapping, and the scheduler's fan-out cost, in one run:  python -m benchmarks.pp_overlap

1. -pp 2 on the default model (15 + 15 layers), each stage a separate process (a ModelRunner on 1 thread, real gloo
   groups on loopback), driven by the real PipelineScheduler as the engine loop drives a group, minus gRPC: plans
   go to the stages as serialized StepPlans over pipes. 16 concurrent greedy requests (random 64-token prompts,
   64 output tokens each) run twice per round, interleaved (ABAB):
     overlapped   one plan per stage in flight, disjoint batches of ceil(16 / 2) requests (what -pp 2 serves)
     alternating  one plan in flight with every request (the stages take turns: what -pp 2 did before)
   Each stage records when it ran each step and how long it waited in sends/receives, so per stage:
   compute-busy time / wall time, and over time how many steps are computing (0, 1, 2 stages) and how many plans
   the scheduler has outstanding. The two modes must produce the same tokens (checked).
2. The scheduler's CPU per step to plan and send to a worker group of 4 ranks vs 1 (benchmarks/tp_plan_cost.py's
   fan_out: 256 running decodes, in-memory streams, interleaved rounds). Target <= 1.1x.
Writes benchmarks/results/pp_overlap.json (with the machine, commit and load) and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "pp_overlap.json"
STOP, RESET = b"stop", b"reset"    # control words on the plan pipe (a serialized StepPlan never equals them)


def stage_main(rank: int, model: str, address: str, plans, answers, threads: int) -> None:
    """One stage's process: execute every plan in order; answer (rank, step, began, ended, comm s, result bytes)."""
    os.environ.setdefault("STEPLOOP_CPU_KERNEL_PROBE", "0")
    import torch

    from steploop.common.pb.steploop.v1 import worker_pb2
    from steploop.common.step_contract import StepPlan
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.distributed.process_group import form_stage_groups
    from steploop.gpu_worker.model_runner import ModelRunner

    config = WorkerConfig(model=model, device="cpu", dtype="float32", num_threads=threads, num_kv_blocks=512,
                          max_model_len=512, pipeline_parallel_size=2, rank=rank)
    runner = ModelRunner.from_config(config, Path(model))
    timeout = timedelta(seconds=120)
    _, whole = form_stage_groups(rank, 1, 2, address, 1, timeout, "127.0.0.1", torch.device("cpu"), None)
    runner.pipe.attach(whole, 1, timeout)
    answers.put((rank, -1, 0.0, 0.0, 0.0, runner.block_size.to_bytes(4, "little")))
    while (data := plans.get()) != STOP:
        if data == RESET:                           # a new scheduler: forget every request
            runner.reset()
            continue
        plan = StepPlan.from_pb(worker_pb2.StepPlan.FromString(data))
        began = time.monotonic()                    # CLOCK_MONOTONIC: one clock for every process
        result = runner.execute(plan)
        ended = time.monotonic()
        if result.error:
            answers.put((rank, -2, 0.0, 0.0, 0.0, result.error.encode()))
            return
        answers.put((rank, plan.step_id, began, ended, result.collective_seconds,
                     result.to_pb().SerializeToString() if runner.samples_here else b""))


class Stages:
    """The two stage processes and their pipes."""

    def __init__(self, model: str, threads: int):
        import torch  # noqa: F401 - the store below is torch's

        from steploop.gpu_worker.distributed.process_group import GroupStore

        ctx = mp.get_context("spawn")
        self.store = GroupStore("127.0.0.1", 2)
        self.plans = [ctx.Queue() for _ in range(2)]
        self.answers = ctx.Queue()
        self.procs = [ctx.Process(target=stage_main, args=(r, model, self.store.address, self.plans[r], self.answers,
                                                           threads), daemon=True) for r in range(2)]
        for p in self.procs:
            p.start()
        ready = [self._take() for _ in range(2)]
        self.block_size = int.from_bytes(ready[0][5], "little")
        self.early = {0: deque(), 1: deque()}

    def _take(self):
        answer = self.answers.get(timeout=600)
        if answer[1] == -2:
            raise RuntimeError(f"stage {answer[0]}: {answer[5].decode()}")
        return answer

    def reset(self) -> None:
        for q in self.plans:
            q.put(RESET)

    def send(self, plan) -> None:
        data = plan.to_pb().SerializeToString()
        for q in self.plans:
            q.put(data)

    def recv(self, plan):
        """Both stages' answers to `plan` (each answers its plans in order); the last stage's carries the tokens."""
        from steploop.common.pb.steploop.v1 import worker_pb2
        from steploop.common.step_contract import StepResult

        while not (self.early[0] and self.early[1]):
            answer = self._take()
            self.early[answer[0]].append(answer)
        spans = [self.early[r].popleft() for r in range(2)]
        assert all(s[1] == plan.step_id for s in spans), (spans, plan.step_id)
        return StepResult.from_pb(worker_pb2.StepResult.FromString(spans[1][5])), spans

    def close(self) -> None:
        for q in self.plans:
            q.put(STOP)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def serve(stages: Stages, overlapped: bool, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt through the scheduler at once, as the engine loop runs it; timings from both stages."""
    from steploop.common.sampling_params import SamplingParams
    from steploop.scheduler.config import SchedulerConfig
    from steploop.scheduler.kv_cache_manager import KVCacheManager
    from steploop.scheduler.pipeline_scheduler import PipelineScheduler
    from steploop.scheduler.request import Request

    stages.reset()
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=len(prompts), max_decode_slowdown=0)
    kv = KVCacheManager(512, stages.block_size, config.enable_prefix_caching)
    sched = PipelineScheduler(config, kv, 512, [], num_stages=2 if overlapped else 1)
    window = 2 if overlapped else 1
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling=sampling))
    tokens = {str(i): [] for i in range(len(prompts))}
    out: deque = deque()
    spans, outstanding = [], []          # stage spans; (time, plans outstanding) at every change
    started = time.monotonic()
    while sched.has_unfinished_requests() or out:
        sent = False
        if len(out) < window and sched.has_unfinished_requests():
            plan = sched.schedule()
            if plan.scheduled_handles or plan.finished_handles or plan.preempted_handles:
                stages.send(plan)
                out.append(plan)
                outstanding.append((time.monotonic(), len(out)))
                sent = True
        if out and (len(out) == window or not sent):
            plan = out.popleft()
            result, step_spans = stages.recv(plan)
            outstanding.append((time.monotonic(), len(out)))
            spans.extend(step_spans)
            for o in sched.update_from_output(plan, result):
                tokens[o.request_id].extend(o.new_token_ids)
    ended = time.monotonic()
    return {"tokens": tokens, "wall": ended - started, "started": started, "ended": ended, "spans": spans,
            "outstanding": outstanding, "steps": len(spans) // 2}


def summarize(run: dict, tick: float) -> dict:
    """Per stage busy / wall; time shares of 0, 1, 2 stages computing and of plans outstanding; a sampled timeline."""
    start, wall = run["started"], run["wall"]
    compute = {0: [], 1: []}             # (began, ended) of each step's compute (its send/receive waits trimmed)
    stage_rows = []
    for rank in (0, 1):
        mine = [s for s in run["spans"] if s[0] == rank]
        busy = sum(e - b for _, _, b, e, _, _ in mine)
        comm = sum(c for *_, c, _ in mine)
        stage_rows.append({"stage": rank, "steps": len(mine), "busy_incl_waits_over_wall": round(busy / wall, 3),
                           "compute_over_wall": round((busy - comm) / wall, 3),
                           "send_recv_wait_s": round(comm, 3)})
        for _, _, b, e, c, _ in mine:
            # stage 0 waits at the end of a step (its send), stage 1 at the start (its receive)
            compute[rank].append((b, e - c) if rank == 0 else (b + c, e))
    n = max(1, int(wall / tick))
    timeline = []
    shares = [0, 0, 0]
    for k in range(n):
        t = start + (k + 0.5) * tick
        computing = [int(any(b <= t < e for b, e in compute[r])) for r in (0, 1)]
        out = 0
        for at, count in run["outstanding"]:
            if at > t:
                break
            out = count
        timeline.append([out, *computing])
        shares[sum(computing)] += 1
    return {"wall_s": round(wall, 2), "steps": run["steps"],
            "output_tok_s": round(sum(len(t) for t in run["tokens"].values()) / wall, 1),
            "stages": stage_rows,
            "share_of_time_stages_computing": {str(k): round(shares[k] / n, 3) for k in range(3)},
            "mean_plans_outstanding": round(statistics.mean(row[0] for row in timeline), 2),
            "timeline_tick_s": tick,
            "timeline_first_2s": timeline[:int(2 / tick)],   # [plans outstanding, stage 0 computing, stage 1 ...]
            }


def compact(text: str) -> str:
    """The timeline's [plans, stage 0, stage 1] triples on one line each, not five."""
    return re.sub(r"\[\s+(\d+),\s+(\d+),\s+(\d+)\s+\]", r"[\1, \2, \3]", text)


def fan_out_ratio(rounds: int, num_running: int, steps: int) -> dict:
    from benchmarks.tp_plan_cost import fan_out

    rows = {1: [], 4: []}
    for _ in range(rounds):
        for ws in (1, 4):
            rows[ws].append(asyncio.run(fan_out(ws, num_running, steps)))
    med = {ws: statistics.median(r["cpu_median_ms"] for r in rows[ws]) for ws in rows}
    return {"num_running": num_running, "steps": steps, "rounds": rounds,
            "cpu_median_ms_ws1": round(med[1], 4), "cpu_median_ms_ws4": round(med[4], 4),
            "ws4_over_ws1": round(med[4] / med[1], 3), "target": "<= 1.1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="ABAB rounds of the two modes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument("--tick", type=float, default=0.02, help="timeline resolution, seconds")
    parser.add_argument("--fan-out-rounds", type=int, default=7, help="interleaved 1-vs-4 rounds (median kept)")
    args = parser.parse_args()
    from benchmarks.machine import machine_info
    from steploop.common.model_path import default_model_dir

    machine = machine_info()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    stages = Stages(str(default_model_dir()), args.threads)
    runs: dict[str, list[dict]] = {"overlapped": [], "alternating": []}
    try:
        serve(stages, True, prompts[:2], 4)                         # warm-up
        for _ in range(args.rounds):
            for mode in ("overlapped", "alternating"):
                runs[mode].append(serve(stages, mode == "overlapped", prompts, args.max_tokens))
    finally:
        stages.close()
    same = all(r["tokens"] == runs["alternating"][0]["tokens"] for rs in runs.values() for r in rs)
    pp = {mode: [summarize(r, args.tick) for r in rs] for mode, rs in runs.items()}
    report = {"machine": machine, "load_average_at_end": os.getloadavg(),
              "flags": {"pipeline_parallel_size": 2, "requests": args.requests, "prompt_len": args.prompt_len,
                        "max_tokens": args.max_tokens, "threads_per_stage": args.threads, "rounds": args.rounds,
                        "model": "SmolLM2-135M-Instruct fp32, 15 + 15 layers", "max_decode_slowdown": 0},
              "same_tokens_in_every_run": same, "pp2": pp,
              "fan_out": fan_out_ratio(args.fan_out_rounds, 256, 200)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(compact(json.dumps(report, indent=1)) + "\n")
    for mode, rows in pp.items():
        for row in rows:
            print(f"{mode:12s} {row['output_tok_s']:7.1f} tok/s  wall {row['wall_s']:6.2f} s  steps {row['steps']:4d}  "
                  f"compute/wall " + " ".join(f"s{s['stage']}={s['compute_over_wall']:.2f}" for s in row["stages"])
                  + f"  stages computing 0/1/2: {row['share_of_time_stages_computing']}"
                  f"  plans out {row['mean_plans_outstanding']}")
    print("same tokens in every run:", same)
    f = report["fan_out"]
    print(f"scheduler CPU per step: ws1 {f['cpu_median_ms_ws1']:.3f} ms, ws4 {f['cpu_median_ms_ws4']:.3f} ms, "
          f"ratio {f['ws4_over_ws1']}")
    print(f"load {machine['load_average_at_start']} -> {report['load_average_at_end']}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
