"""Request spans in the scheduler, only while `steploop.common.tracing.ENABLED`.

One span per request's life ("steploop.scheduler.request", parent: the caller's trace from gRPC metadata) with
GenAI attributes, a child span for its queue time, and events for the steps that mattered (first scheduled,
first token, finished) rather than a span per step or per token. Its traceparent rides to the worker in the
plan's NewRequest.
"""

from __future__ import annotations

import time
from typing import Any

from steploop.common import tracing


def start(rec: Any, request: Any, model: str) -> None:
    from opentelemetry.trace import SpanKind
    s = request.sampling
    attrs = tracing.genai_request_attributes(model, s.max_tokens, s.temperature, s.top_p)
    attrs.update({tracing.SERVICE: "scheduler", "steploop.request_id": request.request_id,
                  "steploop.priority": request.priority, tracing.INPUT_TOKENS: request.num_prompt_tokens})
    rec.arrival_ns = time.time_ns()
    rec.span = tracing.tracer().start_span("steploop.scheduler.request", kind=SpanKind.SERVER, attributes=attrs,
                                           start_time=rec.arrival_ns)
    rec.traceparent = tracing.traceparent_of(rec.span)


def scheduled(rec: Any, step_id: int) -> None:
    """First admission: the queue span ends; the request span notes the step."""
    from opentelemetry import trace
    now = time.time_ns()
    queue = tracing.tracer().start_span("steploop.scheduler.queue", context=trace.set_span_in_context(rec.span),
                                        start_time=rec.arrival_ns, attributes={tracing.SERVICE: "scheduler"})
    queue.end(end_time=now)
    rec.span.add_event("scheduled", {"steploop.step_id": step_id}, timestamp=now)


def first_token(rec: Any, step_id: int) -> None:
    rec.span.add_event("first_token", {"steploop.step_id": step_id})


def finish(rec: Any, reason: str, num_prompt: int, num_output: int, num_cached: int, step_id: int) -> None:
    span = rec.span
    span.set_attributes({tracing.INPUT_TOKENS: num_prompt, tracing.OUTPUT_TOKENS: num_output,
                         tracing.FINISH_REASONS: (reason,), "steploop.cached_tokens": num_cached,
                         "steploop.num_preemptions": rec.request.num_preemptions})
    span.add_event("finished", {"steploop.step_id": step_id, "steploop.finish_reason": reason})
    if reason == "error":
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR, rec.request.error or "engine error"))
    span.end()


def kv_transfer(rec: Any, request_id: str, num_blocks: int, num_bytes: int, seconds: float, ok: bool) -> None:
    """A prefill/decode KV transfer (pd_disagg.py): a child span of the request's, over the prefill worker's send
    (it ended when its result arrived; the worker measured how long it took)."""
    from opentelemetry import trace
    end = time.time_ns()
    parent = trace.set_span_in_context(rec.span) if rec is not None and getattr(rec, "span", None) else None
    span = tracing.tracer().start_span("steploop.scheduler.kv_transfer", context=parent,
                                       start_time=end - int(seconds * 1e9), attributes={
                                           tracing.SERVICE: "scheduler", "steploop.request_id": request_id,
                                           "steploop.kv_transfer.blocks": num_blocks,
                                           "steploop.kv_transfer.bytes": num_bytes, "steploop.kv_transfer.ok": ok})
    span.end(end_time=end)


def kv_pull_start(rec: Any, request_id: str, source: str, num_blocks: int) -> Any:
    """The receiving side of a cross-replica KV pull (kv_pull_import.py): a client span, child of the request's,
    from asking the source replica to its answer; its traceparent rides on the ExportKvBlocks call, so the
    source's export span joins the same trace. End it with kv_pull_end."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind
    parent = trace.set_span_in_context(rec.span) if rec is not None and getattr(rec, "span", None) else None
    return tracing.tracer().start_span("steploop.scheduler.kv_pull", context=parent, kind=SpanKind.CLIENT,
                                       attributes={tracing.SERVICE: "scheduler", "steploop.request_id": request_id,
                                                   "steploop.kv_pull.source": source,
                                                   "steploop.kv_pull.blocks_asked": num_blocks})


def kv_pull_end(span: Any, num_blocks: int, num_bytes: int, reason: str) -> None:
    """The source's answer: how many leading blocks it sent (0: recomputed here, and why)."""
    kv_export_answer(span, num_blocks, num_bytes, reason)
    span.set_attribute("steploop.kv_pull.ok", num_blocks > 0)
    span.end()


def kv_export_answer(span: Any, num_blocks: int, num_bytes: int, reason: str) -> None:
    """A pull's answer on either side's span: the leading blocks sent, their bytes, and why none when none."""
    span.set_attributes({"steploop.kv_pull.blocks": num_blocks, "steploop.kv_pull.bytes": num_bytes})
    if not num_blocks:
        span.set_attribute("steploop.kv_pull.reason", reason)


def kv_export(transfer_id: str, num_asked: int) -> Any:
    """The source side of a pull (servicers.ExportKvBlocks, inside the caller's trace): a server span over the
    export; the caller sets its answer (kv_export_answer) before the block ends it."""
    from opentelemetry.trace import SpanKind
    return tracing.tracer().start_as_current_span(
        "steploop.scheduler.kv_export", kind=SpanKind.SERVER,
        attributes={tracing.SERVICE: "scheduler", "steploop.kv_pull.transfer_id": transfer_id,
                    "steploop.kv_pull.blocks_asked": num_asked})


def pd_choice(rec: Any, choice: Any) -> None:
    """Where the prompt runs (pd_choice.Choice) and, when the step-cost models priced it, both estimates."""
    if rec is None or getattr(rec, "span", None) is None:
        return
    attrs = {"steploop.pd.choice": choice.label, "steploop.pd.reason": choice.reason}
    if choice.local_seconds >= 0.0:
        attrs.update({"steploop.pd.local_seconds": choice.local_seconds,
                      "steploop.pd.disaggregated_seconds": choice.remote_seconds})
    rec.span.set_attributes(attrs)
