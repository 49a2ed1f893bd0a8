"""EngineObserver: the scheduler's metrics (vllm:* and steploop:*), per-request log lines, the periodic stats
line and request spans, all fed by a handful of hooks in the step loop.

    add_request ─▶ on_arrival      schedule() ─▶ on_plan (send time; first admission)
    update_from_output ─▶ on_step(StepStats) (one pass over the step's outputs: tokens, TTFT, ITL, finishes)
    abort / no worker ─▶ on_abort    attach / detach ─▶ on_attach(WorkerInfo) / on_detach

The loop pushes data (stats.py) and never hands itself over: gauges and the counters the scheduler already keeps
(preemptions, prefix-cache and spec-decode stats) come from the `load_report` callable at scrape time. A step
costs a few int additions and list appends; histograms fold their pending values when scraped (`BatchHistogram`).

Under --disable-log-stats (`common.metrics.ENABLED` False) `make_observer` returns a NullEngineObserver instead:
the same hooks, doing nothing.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from steploop.common import metrics as m
from steploop.common import tracing
from steploop.common.step_contract import StepPlan, WorkerInfo
from steploop.scheduler import metrics_export
from steploop.scheduler import tracing as request_tracing
from steploop.scheduler.request import Request, RequestOutput, RequestStatus
from steploop.scheduler.stats import EngineLoad, StepStats

log = logging.getLogger("steploop.scheduler.stats")

FINISHED_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                    RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error",
                    RequestStatus.FINISHED_REJECTED: "error"}


class _Live:
    """Timestamps (time.monotonic) of one live request."""
    __slots__ = (
        "arrival",
        "arrival_ns",
        "first_token",
        "last_token",
        "request",
        "scheduled",
        "span",
        "traceparent",
    )

    def __init__(self, request: Request) -> None:
        self.request = request
        self.arrival = request.arrival_time
        self.scheduled = self.first_token = self.last_token = None
        self.span = None
        self.traceparent = ""


class EngineObserver:
    def __init__(self, load_report: Callable[[], EngineLoad], enable_prefix_caching: bool) -> None:
        self.load_report = load_report                    # the engine's load and counters now (scrape time)
        self.enable_prefix_caching = enable_prefix_caching
        self.worker_info: WorkerInfo | None = None        # of the last worker that attached
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.live: dict[str, _Live] = {}
        self.prompt_tokens = self.generation_tokens = self.plan_bytes = self.num_steps = 0
        self.resumed_requests = 0                    # arrived with outputs delivered elsewhere (migrated in)
        self.attaches = self.detaches = 0
        self.success: Counter[str] = Counter({r: 0 for r in FINISHED_REASONS.values()})
        self.aborts: Counter[str] = Counter()
        self._sent: dict[int, float] = {}                 # step_id -> when its plan left
        self._last_log = (time.monotonic(), 0, 0, 0, 0, 0)  # when, prompt, generation, prefix queries, hits, resumed
        self.ttft = m.BatchHistogram(m.TTFT_BUCKETS)
        self.itl = m.BatchHistogram(m.ITL_BUCKETS)        # also exported as vllm:time_per_output_token_seconds
        self.tpot = m.BatchHistogram(m.ITL_BUCKETS)
        self.e2e, self.queue, self.prefill, self.decode, self.inference = (
            m.BatchHistogram(m.REQUEST_LATENCY_BUCKETS) for _ in range(5))
        self.iteration_tokens = m.BatchHistogram(m.ITERATION_TOKENS_BUCKETS)
        self.step_duration = m.BatchHistogram(m.STEP_SECONDS_BUCKETS)
        self.round_trip = m.BatchHistogram(m.STEP_SECONDS_BUCKETS)
        self.forward = m.BatchHistogram(m.STEP_SECONDS_BUCKETS)
        self.plan_size = m.BatchHistogram(m.BYTES_BUCKETS)
        self.req_prompt = self.req_generation = None       # sized by max_model_len once a worker attaches

    @property
    def model_name(self) -> str:
        info = self.worker_info
        return info.model_name if info is not None else ""

    # ---- hooks --------------------------------------------------------------------------------------------------
    def on_arrival(self, request: Request) -> None:
        rec = self.live[request.request_id] = _Live(request)
        if request.output_token_ids:
            self.resumed_requests += 1
        if tracing.ENABLED:
            request_tracing.start(rec, request, self.model_name)

    def on_plan(self, plan: StepPlan, new_request_ids: list[str]) -> None:
        """Before the plan is sent: new_request_ids are its new requests' ids (their traceparents go with it)."""
        now = self._sent[plan.step_id] = time.monotonic()
        live = self.live
        for new, request_id in zip(plan.new_requests, new_request_ids):
            rec = live.get(request_id)
            if rec is None:
                continue
            if rec.scheduled is None:
                rec.scheduled = now
                if rec.span is not None:
                    request_tracing.scheduled(rec, plan.step_id)
            new.traceparent = rec.traceparent

    def on_step(self, step: StepStats) -> None:
        now = time.monotonic()
        self.num_steps += 1
        sent = self._sent.pop(step.step_id, None)
        if sent is not None:
            self.step_duration.pending.append(now - sent)
            self.round_trip.pending.append(max(now - sent - step.forward_seconds, 0.0))
        self.forward.pending.append(step.forward_seconds)
        self.iteration_tokens.pending.append(step.num_scheduled_tokens)
        self.plan_size.pending.append(step.plan_bytes)
        self.plan_bytes += step.plan_bytes
        outputs, step_id = step.outputs, step.step_id
        # The one per-request loop: a dict lookup, a subtraction and an append per request that sampled.
        get, itl, generated = self.live.get, [], 0
        add_itl = itl.append
        for out in outputs:
            rec = get(out.request_id)
            if rec is None:
                continue
            tokens = out.new_token_ids
            if tokens:
                generated += len(tokens)
                last = rec.last_token
                if last is not None:
                    add_itl(now - last)
                else:
                    self._first_token(rec, out, now, step_id)
                rec.last_token = now
            if out.finish_reason is not None:
                self._finish(rec, FINISHED_REASONS[out.finish_reason], out.num_prompt_tokens,
                             out.num_output_tokens, out.num_cached_tokens, now, step_id)
        self.generation_tokens += generated
        if itl:
            self.itl.observe_many(itl)
        if len(self.step_duration.pending) > m.BatchHistogram.FOLD_AT:
            for h in (self.step_duration, self.round_trip, self.forward, self.iteration_tokens, self.plan_size):
                h.fold()

    def _first_token(self, rec: _Live, out: RequestOutput, now: float, step_id: int) -> None:
        rec.first_token = now
        self.ttft.pending.append(now - rec.arrival)
        self.prompt_tokens += out.num_prompt_tokens
        if rec.span is not None:
            request_tracing.first_token(rec, step_id)

    def on_abort(self, request_id: str, reason: str, finished_reason: str = "abort") -> None:
        """A live request ended outside a step: the caller left, or it failed for want of a worker."""
        rec = self.live.get(request_id)
        if rec is None:
            return
        self.aborts[reason] += 1
        r = rec.request
        self._finish(rec, finished_reason, r.num_prompt_tokens, r.num_output_tokens, r.num_cached_tokens,
                     time.monotonic(), -1)

    def on_attach(self, info: WorkerInfo) -> None:
        self.attaches += 1
        self.worker_info = info
        if self.req_prompt is None:
            self.req_prompt = m.BatchHistogram(m.buckets_1_2_5(info.max_model_len))
            self.req_generation = m.BatchHistogram(m.buckets_1_2_5(info.max_model_len))

    def on_detach(self) -> None:
        self.detaches += 1
        self._sent.clear()

    # ---- finished requests --------------------------------------------------------------------------------------
    def _finish(self, rec: _Live, reason: str, num_prompt: int, num_output: int, num_cached: int, now: float,
                step_id: int) -> None:
        del self.live[rec.request.request_id]
        self.success[reason] += 1
        e2e = now - rec.arrival
        self.e2e.pending.append(e2e)
        if self.req_prompt is not None:
            self.req_prompt.pending.append(num_prompt)
            self.req_generation.pending.append(num_output)
        if rec.scheduled is not None:
            self.queue.pending.append(rec.scheduled - rec.arrival)
        ttft = None
        if rec.first_token is not None:
            ttft = rec.first_token - rec.arrival
            scheduled = rec.scheduled if rec.scheduled is not None else rec.arrival
            decode = rec.last_token - rec.first_token
            self.prefill.pending.append(rec.first_token - scheduled)
            self.decode.pending.append(decode)
            self.inference.pending.append(rec.last_token - scheduled)
            self.tpot.pending.append(decode / (num_output - 1) if num_output > 1 else 0.0)
        if rec.span is not None:
            request_tracing.finish(rec, reason, num_prompt, num_output, num_cached, step_id)
        if log.isEnabledFor(logging.INFO):
            log.info("finished %s: prompt %d, output %d, cached %d, ttft %s, e2e %.3fs, %s, preemptions %d",
                     rec.request.request_id, num_prompt, num_output, num_cached,
                     "-" if ttft is None else f"{ttft:.3f}s", e2e, reason, rec.request.num_preemptions,
                     extra={"request_id": rec.request.request_id, "prompt_tokens": num_prompt,
                            "output_tokens": num_output, "cached_tokens": num_cached, "ttft_s": ttft,
                            "e2e_s": round(e2e, 6), "finish_reason": reason,
                            "preemptions": rec.request.num_preemptions})

    # ---- Prometheus -----------------------------------------------------------------------------------------
    def collect(self):
        yield from metrics_export.families(self, [self.model_name])

    # ---- the periodic stats line ----------------------------------------------------------------------------
    def log_stats(self) -> None:
        """One line of throughput and load since the last call, when anything happened."""
        now, load = time.monotonic(), self.load_report()
        then, prompt, gen, queries, hits, resumed = self._last_log
        running, waiting, counts = load.num_running, load.num_waiting, load.counters
        self._last_log = (now, self.prompt_tokens, self.generation_tokens, counts.prefix_queries, counts.prefix_hits,
                          self.resumed_requests)
        if self.prompt_tokens == prompt and self.generation_tokens == gen and not running and not waiting:
            return
        dt = max(now - then, 1e-9)
        dq, dh = counts.prefix_queries - queries, counts.prefix_hits - hits
        usage = load.kv_cache_usage * 100
        log.info("engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV usage %.1f%%, "
                 "prefix cache hit rate %.1f%%, migrated in %d", (self.prompt_tokens - prompt) / dt,
                 (self.generation_tokens - gen) / dt, running, waiting, usage, 100 * dh / dq if dq else 0.0,
                 self.resumed_requests - resumed,
                 extra={"prompt_throughput": round((self.prompt_tokens - prompt) / dt, 2),
                        "generation_throughput": round((self.generation_tokens - gen) / dt, 2),
                        "running": running, "waiting": waiting, "kv_usage_perc": round(usage, 2),
                        "prefix_hit_rate": round(dh / dq, 4) if dq else 0.0,
                        "migrated_in": self.resumed_requests - resumed})


def _ignore(*_: Any, **__: Any) -> None:
    return None


class NullEngineObserver:
    """--disable-log-stats: EngineObserver's hooks as no-ops (no metrics, no per-request or stats log lines,
    no spans); its registry is empty, so /metrics and Engine.GetMetrics answer with no samples."""

    def __init__(self, load_report: Callable[[], EngineLoad], enable_prefix_caching: bool) -> None:
        self.registry = CollectorRegistry(auto_describe=False)

    on_arrival = on_plan = on_step = on_abort = on_attach = on_detach = log_stats = staticmethod(_ignore)


def make_observer(load_report: Callable[[], EngineLoad],
                  enable_prefix_caching: bool) -> EngineObserver | NullEngineObserver:
    cls = EngineObserver if m.ENABLED else NullEngineObserver
    return cls(load_report, enable_prefix_caching)
