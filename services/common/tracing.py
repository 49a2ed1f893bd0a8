"""OpenTelemetry tracing shared by the services: off (and free) unless --otlp-traces-endpoint is set.

Every entry point checks the module-level `ENABLED` first; while it is False nothing is imported from
OpenTelemetry, no header is parsed and no span is created. When on, a request's trace is:

    gateway   "POST /v1/chat/completions" (SERVER; honours the client's `traceparent`)
                └─ "chat <model>" (CLIENT, one per choice; GenAI attributes)  ── traceparent in gRPC metadata ──▶
    scheduler   "steploop.scheduler.request" (SERVER; events: scheduled, first_token, preempted, finished)
                  └─ "steploop.scheduler.queue" (arrival → first scheduled)   ── traceparent in NewRequest ──▶
    worker      "steploop.worker.prefill" (plan received → first token sampled)

Each service exports with OTLP/gRPC (`opentelemetry-exporter-otlp-proto-grpc`, the `otel` extra) in batches.
Tests call `enable(provider)` with an SDK provider whose exporter keeps spans in memory.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)

ENABLED = False          # read by every hook before doing anything
_tracer: Any = None
_propagator: Any = None
_NULL = contextlib.nullcontext()

# GenAI semantic-convention attribute names (https://opentelemetry.io/docs/specs/semconv/gen-ai/).
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
SERVICE = "steploop.service"


def setup_tracing(service: str, endpoint: str | None) -> bool:
    """Turns tracing on with an OTLP/gRPC exporter to `endpoint` (e.g. http://otel-collector:4317); no-op
    when endpoint is empty."""
    if not endpoint:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise SystemExit(f"--otlp-traces-endpoint needs the OTLP exporter: pip install 'steploop[otel]' ({exc})")
    provider = TracerProvider(resource=Resource.create({"service.name": f"steploop-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=endpoint, insecure=not endpoint.startswith("https://"))))
    atexit.register(provider.shutdown)
    enable(provider)
    log.info("tracing on: OTLP spans to %s", endpoint)
    return True


def enable(provider: Any) -> None:
    global ENABLED, _tracer, _propagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    _tracer = provider.get_tracer("steploop")
    _propagator = TraceContextTextMapPropagator()
    ENABLED = True


def disable() -> None:
    global ENABLED, _tracer
    ENABLED, _tracer = False, None


def tracer() -> Any:
    return _tracer


# ---- W3C trace context in and out ----------------------------------------------------------------------------
def extract(carrier: Any) -> Any:
    """An OTel Context from a mapping holding `traceparent` (HTTP headers, gRPC metadata as a dict)."""
    return _propagator.extract(carrier)


def context_from_traceparent(traceparent: str) -> Any:
    return _propagator.extract({"traceparent": traceparent})


def traceparent_of(span: Any) -> str:
    """`span`'s context as a W3C traceparent string (what the plan carries to the worker)."""
    from opentelemetry import trace
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def grpc_metadata(span: Any) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata that makes `span` the parent on the other side; None when tracing is off."""
    if span is None:
        return None
    return (("traceparent", traceparent_of(span)),)


def grpc_server_context(servicer_context: Any):
    """A context manager making the caller's trace (gRPC metadata `traceparent`) current; a shared no-op
    when tracing is off."""
    if not ENABLED:
        return _NULL
    from opentelemetry import context as otel_context
    metadata = {k: v for k, v in (servicer_context.invocation_metadata() or ()) if isinstance(v, str)}
    return _attached(otel_context, extract(metadata))


def traceparent_context(traceparent: str):
    """A context manager making the trace of a W3C traceparent string current (a Session request carries its
    caller's in the message, as it cannot ride on per-call metadata); a shared no-op when tracing is off."""
    if not ENABLED or not traceparent:
        return _NULL
    from opentelemetry import context as otel_context
    return _attached(otel_context, context_from_traceparent(traceparent))


@contextlib.contextmanager
def _attached(otel_context: Any, ctx: Any):
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def genai_request_attributes(model: str, max_tokens: int | None, temperature: float, top_p: float,
                             operation: str = "text_completion") -> dict[str, Any]:
    """max_tokens None (unset: what fits in the context) leaves the attribute out."""
    attrs = {OPERATION: operation, REQUEST_MODEL: model, TEMPERATURE: float(temperature),
             TOP_P: float(top_p) if top_p else 1.0}
    if max_tokens is not None:
        attrs[MAX_TOKENS] = int(max_tokens)
    return attrs
