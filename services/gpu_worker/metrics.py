"""WorkerObserver: the worker's few metrics (forward time, tokens per step, KV blocks) and, when tracing is
on, one span per traced request from the plan that brought it to the step that sampled its first token
(or dropped it). Fed once per step by the plan-stream loop; scraped on --worker-metrics-port. Under
--disable-log-stats the worker uses NullWorkerObserver, whose hooks do nothing."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from steploop.common import metrics as m
from steploop.common import tracing


class WorkerObserver:
    def __init__(self, info: Any) -> None:
        self.info = info                                  # WorkerInfo: model, KV blocks
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.steps = self.tokens = 0
        self.forward = m.BatchHistogram(m.STEP_SECONDS_BUCKETS)
        self.step_tokens = m.BatchHistogram(m.ITERATION_TOKENS_BUCKETS)
        self._spans: dict[int, Any] = {}                 # handle -> open span (tracing only)

    def before(self, plan: Any) -> None:
        if tracing.ENABLED:
            for new in plan.new_requests:
                if new.traceparent:
                    self._start_span(new, plan.step_id)

    def after(self, plan: Any, result: Any) -> None:
        self.steps += 1
        n = sum(plan.num_scheduled_tokens)
        self.tokens += n
        self.forward.observe(result.forward_seconds)
        self.step_tokens.observe(n)
        if len(self.forward.pending) > m.BatchHistogram.FOLD_AT:
            self.forward.fold()
            self.step_tokens.fold()
        if self._spans:
            self._end_spans(plan, result)

    def reset(self) -> None:
        """The stream broke: every request is forgotten."""
        for span in self._spans.values():
            span.end()
        self._spans.clear()

    # ---- spans ---------------------------------------------------------------------------------------------
    def _start_span(self, new: Any, step_id: int) -> None:
        old = self._spans.pop(new.handle, None)
        if old is not None:
            old.end()
        self._spans[new.handle] = tracing.tracer().start_span(
            "steploop.worker.prefill", context=tracing.context_from_traceparent(new.traceparent), attributes={
                tracing.SERVICE: "worker", "steploop.worker_id": self.info.worker_id, "steploop.handle": new.handle,
                "steploop.first_step_id": step_id, "steploop.prompt_tokens": len(new.prompt_token_ids),
                "steploop.resumed_output_tokens": len(new.output_token_ids),
                "steploop.cached_tokens": new.num_computed_tokens})

    def _end_spans(self, plan: Any, result: Any) -> None:
        for handle in list(result.sampled) + plan.finished_handles + plan.preempted_handles:
            span = self._spans.pop(handle, None)
            if span is not None:
                span.set_attribute("steploop.last_step_id", plan.step_id)
                span.end()

    # ---- Prometheus -----------------------------------------------------------------------------------------
    def collect(self):
        labels, names = [self.info.model_name], ["model_name"]
        for name, doc, value in (("steploop:worker_steps", "Steps the worker ran.", self.steps),
                                 ("steploop:worker_tokens", "Tokens the worker's forward computed.", self.tokens)):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(labels, value)
            yield family
        blocks = GaugeMetricFamily("steploop:worker_kv_blocks", "KV blocks this worker holds (block 0 included).",
                                   labels=names)
        blocks.add_metric(labels, self.info.num_kv_blocks)
        yield blocks
        for name, doc, hist in (
                ("steploop:worker_step_forward_seconds", "Forward + sampling time of one step.", self.forward),
                ("steploop:worker_step_tokens", "Tokens computed in one step.", self.step_tokens)):
            family = HistogramMetricFamily(name, doc, labels=names)
            hist.add_to(family, labels)
            yield family


class NullWorkerObserver:
    """--disable-log-stats: WorkerObserver's hooks as no-ops; its registry is empty."""

    def __init__(self, info: Any) -> None:
        self.info = info
        self.registry = CollectorRegistry(auto_describe=False)

    def before(self, plan: Any) -> None:
        pass

    def after(self, plan: Any, result: Any) -> None:
        pass

    def reset(self) -> None:
        pass


def make_observer(info: Any) -> WorkerObserver | NullWorkerObserver:
    return WorkerObserver(info) if m.ENABLED else NullWorkerObserver(info)
