"""Tracing switched on into memory for a test: `with recorded_spans() as memory:` ... `memory.get_finished_spans()`
(steploop.common.tracing is off again after the block, whatever happened in it)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def recorded_spans():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from steploop.common import tracing

    memory, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.enable(provider)
    try:
        yield memory
    finally:
        tracing.disable()
