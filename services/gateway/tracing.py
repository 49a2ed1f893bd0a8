"""The gateway's spans, only while `steploop.common.tracing.ENABLED`: one SERVER span per HTTP request (the
client's `traceparent` header is its parent) and one GenAI CLIENT span per engine call ("chat <model>"), whose
context travels to the scheduler as gRPC metadata."""

from __future__ import annotations

import contextvars
from typing import Any

from steploop.common import tracing

# (operation, served model name) of the HTTP request being handled; set by the HTTP span.
_REQUEST: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("steploop_genai",
                                                                         default=("text_completion", ""))
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
FINISH_NAMES = {1: "stop", 2: "length", 3: "abort", 4: "error", 5: "error"}


def start_http(request: Any, route: str, model: str) -> Any:
    from opentelemetry.trace import SpanKind
    attrs = {tracing.SERVICE: "gateway", "http.request.method": request.method, "http.route": route,
             "url.path": request.path}
    operation = OPERATIONS.get(route)
    if operation is not None:
        attrs.update({tracing.OPERATION: operation, tracing.REQUEST_MODEL: model})
        _REQUEST.set((operation, model))
    return tracing.tracer().start_span(f"{request.method} {route}", context=tracing.extract(request.headers),
                                       kind=SpanKind.SERVER, attributes=attrs)


def end_http(span: Any, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def start_generate(request_id: str, prompt_ids: Any, s: Any) -> Any:
    """A CLIENT span for one engine call (one choice), child of the current HTTP span; s: its SamplingParams."""
    from opentelemetry.trace import SpanKind
    operation, model = _REQUEST.get()
    attrs = tracing.genai_request_attributes(model, s.max_tokens, s.temperature, s.top_p, operation)
    attrs.update({tracing.SERVICE: "gateway", "steploop.request_id": request_id,
                  tracing.INPUT_TOKENS: len(prompt_ids)})
    return tracing.tracer().start_span(f"{operation} {model}".strip(), kind=SpanKind.CLIENT, attributes=attrs)


def record_finish(span: Any, chunk: Any) -> None:
    span.set_attributes({tracing.INPUT_TOKENS: chunk.usage.prompt_tokens,
                         tracing.OUTPUT_TOKENS: chunk.usage.completion_tokens,
                         tracing.FINISH_REASONS: (FINISH_NAMES.get(chunk.finish_reason, "unknown"),),
                         "steploop.cached_tokens": chunk.usage.cached_tokens})
