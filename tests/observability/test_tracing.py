"""One request, one trace across gateway, scheduler and worker, all in this process and event loop (gateway app
with a real EngineClient, SchedulerService over gRPC, the worker's plan-stream loop with a fake runner), sharing
one tracer provider whose exporter keeps spans in memory. And with tracing off, no span at all."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing
from services.common.step_contract import WorkerInfo
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EngineClient
from services.gateway.server import bound_port, start_site
from services.gpu_worker import server as worker_server
from services.gpu_worker.config import WorkerConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import SchedulerService
from services.scheduler.server_config import ServerConfig
from tests.scheduler.sched_factories import EOS, FakeWorker

pytestmark = pytest.mark.asyncio
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class FakeRunner:
    """What gpu_worker.server needs of a ModelRunner: info, execute(plan), reset()."""

    def __init__(self) -> None:
        self.info = WorkerInfo(worker_id="fake-0", model_name="fake-model", block_size=4, num_kv_blocks=256,
                               max_model_len=2048, vocab_size=49152, eos_token_ids=(EOS,))
        self.reset()

    def execute(self, plan):
        return self.worker.execute(plan)

    def reset(self) -> None:
        self.worker = FakeWorker(block_size=4)


async def one_request(tokenizer, headers: dict) -> dict:
    """Gateway + scheduler + worker in this loop; one chat completion; everything stopped again."""
    svc = await SchedulerService(SchedulerConfig(), ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1.0,
                                                                 log_stats_interval=0)).start()
    address = f"127.0.0.1:{svc.port}"
    stop = asyncio.Event()
    worker = asyncio.create_task(worker_server.serve(WorkerConfig(scheduler_address=address, block_size=4),
                                                     runner=FakeRunner(), stop=stop))
    engine = EngineClient(address)
    app = create_app(GatewayConfig(port=0, served_model_name="test-model"), engine, tokenizer)
    runner, _ = await start_site(app, "127.0.0.1", 0, 1.0)
    try:
        while svc.loop.link is None:
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{bound_port(runner)}/v1/chat/completions", headers=headers,
                                 json={"model": "test-model", "max_tokens": 4, "temperature": 0,
                                       "messages": [{"role": "user", "content": "Hi"}]}) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()
    finally:
        await runner.cleanup()
        await engine.close()
        stop.set()
        await worker
        await svc.stop()


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider
    tracing.disable()


async def test_one_trace_across_the_three_services(tokenizer, exporter):
    memory, provider = exporter
    tracing.enable(provider)
    body = await one_request(tokenizer, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
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
    assert request.parent.span_id == client.context.span_id                        # via gRPC metadata
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
