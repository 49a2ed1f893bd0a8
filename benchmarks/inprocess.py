"""The same scheduler core and ModelRunner as the cluster, in ONE process: no gRPC, no HTTP, no tokenizer.

It mirrors EngineLoop.run: schedule, execute (one forward thread, like the worker's executor), update, with one
plan in flight under async scheduling (plan N+1 is scheduled and queued before result N is applied). Per-request
timelines are recorded when update_from_output returns a request's tokens, so the metrics are the same
definitions the HTTP client uses (steploop.bench.metrics).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque

from steploop.bench.metrics import RequestResult, compute_metrics
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request


class InProcessEngine:
    def __init__(self, model_dir, num_kv_blocks: int, sched_config: SchedulerConfig | None = None,
                 num_threads: int | None = None, max_model_len: int | None = None):
        from steploop.gpu_worker.config import WorkerConfig
        from steploop.gpu_worker.model_runner import ModelRunner

        self.sched_config = sched_config or SchedulerConfig()
        self.runner = ModelRunner.from_config(
            WorkerConfig(model=str(model_dir), num_kv_blocks=num_kv_blocks, device="cpu",
                         num_threads=num_threads, **({"max_model_len": max_model_len} if max_model_len else {})),
            model_dir)

    def _new_scheduler(self):
        info = self.runner.info
        self.runner.reset()
        kv = KVCacheManager(info.num_kv_blocks, info.block_size, self.sched_config.enable_prefix_caching)
        return make_scheduler(self.sched_config, kv, info.max_model_len, list(info.eos_token_ids))

    def run(self, prompts: list[tuple[list[int], int]],
            max_concurrency: int | None = None) -> tuple[dict, list[RequestResult]]:
        """Greedy, ignore_eos. Without max_concurrency every prompt arrives at once; with it, a closed loop like
        the bench client's --max-concurrency N: at most N requests are in the scheduler, and each time one
        finishes the next prompt is added (before the next step is scheduled). TTFT and latency count from the
        moment a request is added, as the client counts from when it sends."""
        sched = self._new_scheduler()
        results = {f"r{i}": RequestResult(prompt_len=len(ids)) for i, (ids, _) in enumerate(prompts)}
        limit = max_concurrency or len(prompts)
        pending = deque(enumerate(prompts))
        live = 0
        sent: dict[str, float] = {}
        last: dict[str, float] = {}

        def admit() -> None:
            nonlocal live
            while pending and live < limit:
                i, (ids, n) = pending.popleft()
                rid = f"r{i}"
                sent[rid] = results[rid].start_time = time.perf_counter()
                sched.add_request(Request(rid, list(ids),
                                          sampling=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)))
                live += 1

        window = 2 if self.sched_config.async_scheduling else 1
        start = time.perf_counter()
        admit()
        outstanding: deque = deque()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="forward") as pool:
            while outstanding or sched.has_unfinished_requests():
                sent_plan = False
                if len(outstanding) < window and sched.has_unfinished_requests():
                    plan = sched.schedule()
                    if plan.scheduled_handles or plan.finished_handles or plan.preempted_handles:
                        outstanding.append((plan, pool.submit(self.runner.execute, plan)))
                        sent_plan = True
                if outstanding and (len(outstanding) == window or not sent_plan):
                    plan, future = outstanding.popleft()
                    outputs = sched.update_from_output(plan, future.result())
                    now = time.perf_counter()
                    for out in outputs:
                        self._record(results[out.request_id], out, now, sent[out.request_id], last)
                        live -= bool(out.finished)
                    admit()
        duration = time.perf_counter() - start
        if pending or live:
            raise RuntimeError(f"in-process run ended with {len(pending)} requests never added, {live} unfinished")
        ordered = list(results.values())
        return compute_metrics(ordered, duration), ordered

    @staticmethod
    def _record(r: RequestResult, out, now: float, start: float, last: dict) -> None:
        k = len(out.new_token_ids)
        if k:
            if r.output_tokens == 0:
                r.ttft = now - start
                r.itl.extend([0.0] * (k - 1))
            else:
                gap = now - last[out.request_id]
                r.itl.extend([gap / k] * k)
            r.output_tokens += k
            last[out.request_id] = now
        if out.finished:
            r.latency, r.success = now - start, not out.error
            r.error = out.error
