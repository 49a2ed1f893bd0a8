"""One request, one trace across gateway, scheduler and worker, all in this process and event loop (gateway app
with a real EngineClient, SchedulerService over gRPC, the worker's plan-stream loop with a fake runner), sharing
one tracer provider whose exporter keeps spans in memory. And with tracing off, no span at all."""

from __future__ import annotations

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from steploop.common import tracing
from tests.observability.inprocess_cluster import MODEL, inprocess_cluster

pytestmark = pytest.mark.asyncio
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def one_request(tokenizer, headers: dict, engine_session: bool = True) -> dict:
    """One chat completion through gateway + scheduler + worker in this loop; everything stopped again."""
    async with (inprocess_cluster(tokenizer, engine_session) as cluster, aiohttp.ClientSession() as http,
                http.post(f"{cluster.base_url}/v1/chat/completions", headers=headers,
                          json={"model": MODEL, "max_tokens": 4, "temperature": 0,
                                "messages": [{"role": "user", "content": "Hi"}]}) as resp):
        assert resp.status == 200, await resp.text()
        return await resp.json()


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider
    tracing.disable()


@pytest.mark.parametrize("engine_session", [True, False], ids=["session", "generate-calls"])
async def test_one_trace_across_the_three_services(tokenizer, exporter, engine_session):
    memory, provider = exporter
    tracing.enable(provider)
    body = await one_request(tokenizer, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, engine_session)
    spans = memory.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}     # one trace, the client's
    by_name = {s.name: s for s in spans}
    http = by_name["POST /v1/chat/completions"]
    client = by_name["chat test-model"]
    request = by_name["steploop.scheduler.request"]
    queue = by_name["steploop.scheduler.queue"]
    prefill = by_name["steploop.worker.prefill"]
    assert format(http.parent.span_id, "016x") == CLIENT_SPAN
    assert client.parent.span_id == http.context.span_id
    assert request.parent.span_id == client.context.span_id                        # in the Session message, or gRPC metadata
    assert queue.parent.span_id == request.context.span_id
    assert prefill.parent.span_id == request.context.span_id                       # via the plan's NewRequest
    assert {s.attributes[tracing.SERVICE] for s in spans} == {"gateway", "scheduler", "worker"}
    usage = body["usage"]
    for span in (client, request):
        assert span.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert span.attributes["gen_ai.request.max_tokens"] == 4
        assert span.attributes["gen_ai.request.temperature"] == 0.0
        assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == (body["choices"][0]["finish_reason"],)
    assert client.attributes["gen_ai.request.model"] == "test-model"
    assert http.attributes["gen_ai.operation.name"] == client.attributes["gen_ai.operation.name"] == "chat"
    assert [e.name for e in request.events] == ["scheduled", "first_token", "finished"]


async def test_tracing_off_creates_no_spans(tokenizer, exporter, monkeypatch):
    memory, provider = exporter
    tracing.enable(provider)
    tracing.disable()

    def no_tracer():
        raise AssertionError("a span was started with tracing off")

    monkeypatch.setattr(tracing, "tracer", no_tracer)
    await one_request(tokenizer, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert memory.get_finished_spans() == ()
