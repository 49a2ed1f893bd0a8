"""The Batch API through the real openai SDK against a real gateway (HTTP on a free port) in front of the fake
engine: upload, create, retrieve until done, the output and error files (each custom_id answered once, in input
order), list, cancel, every line background work at the lowest priority (and a client's own request
interactive), and the limits."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json

import openai
import pytest
import pytest_asyncio

from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.server import start_batches
from tests.gateway.conftest import SERVED_NAME, Gateway, serving_app
from tests.gateway.fake_engine import start_fake_engine

KEY = "user-key"
BATCH_PRIORITY = 2**31 - 1


@pytest_asyncio.fixture
async def batch_gateway(fake_engine, tokenizer, tmp_path, request):
    overrides = getattr(request, "param", {})
    config = GatewayConfig(port=0, served_model_name=SERVED_NAME, api_key=KEY, batch_dir=str(tmp_path / "batches"),
                           batch_concurrency=3)
    config = dataclasses.replace(config, **overrides)
    server, address, health = await start_fake_engine(fake_engine)
    try:
        async with serving_app(EngineClient(address), tokenizer, config) as (url, app):
            start_batches(app, "127.0.0.1", int(url.rsplit(":", 1)[1]))
            yield Gateway(url, fake_engine, health, app)
    finally:
        await server.stop(None)


def _jsonl(lines: list[dict]) -> io.BytesIO:
    data = io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())
    data.name = "batch.jsonl"
    return data


def _chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": SERVED_NAME, "messages": [{"role": "user", "content": f"question {i}"}],
                     "max_tokens": 4, **body}}


async def _until_done(client, batch_id: str, timeout: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert asyncio.get_running_loop().time() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.05)


async def test_openai_sdk_batch_round_trip(batch_gateway):
    client = batch_gateway.openai(KEY)
    lines = [_chat_line(i) for i in range(7)] + [_chat_line(7, temperature=9)]    # the last one is a 400
    file = await client.files.create(file=_jsonl(lines), purpose="batch")
    assert (file.object, file.purpose, file.filename) == ("file", "batch", "batch.jsonl")
    assert (await client.files.retrieve(file.id)).bytes == file.bytes
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"run": "sdk"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 8
    batch = await _until_done(client, batch.id)
    assert batch.status == "completed" and batch.metadata == {"run": "sdk"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (7, 1)
    output = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(7)]     # each once, in input order
    for o in output:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["body"]["choices"][0]["message"]["content"]
    errors = [json.loads(x) for x in (await client.files.content(batch.error_file_id)).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("req-7", 400)]
    assert errors[0]["error"]["message"]
    assert {(r.priority, r.background) for r in batch_gateway.engine.requests} == {(BATCH_PRIORITY, True)}
    assert len(batch_gateway.engine.requests) == 7       # each line ran once (the 400 never reached the engine)
    await client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2)
    assert not batch_gateway.engine.requests[-1].background    # a client's own request stays interactive
    listed = await client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    files = await client.files.list()
    assert {f.purpose for f in files.data} == {"batch", "batch_output"}


async def test_cancel_stops_a_running_batch(batch_gateway):
    batch_gateway.engine.token_delay_s = 0.05          # 4 tokens: 0.2 s a line, 3 at a time
    client = batch_gateway.openai(KEY)
    file = await client.files.create(file=_jsonl([_chat_line(i) for i in range(30)]), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    while (await client.batches.retrieve(batch.id)).request_counts.completed < 2:
        await asyncio.sleep(0.05)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = await _until_done(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = batch.request_counts.completed
    assert 2 <= done < 30
    output = (await client.files.content(batch.output_file_id)).text.splitlines()
    assert len(output) == done
    with pytest.raises(Exception) as err:
        await client.batches.cancel(batch.id + "0")
    assert "404" in str(err.value) or "batch_not_found" in str(err.value)


async def test_bad_inputs_and_limits(batch_gateway):
    client = batch_gateway.openai(KEY)
    file = await client.files.create(file=_jsonl([_chat_line(0), {"custom_id": "x", "url": "/v1/completions",
                                                                  "body": {}}]), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    assert batch.status == "failed" and batch.errors.data[0].code == "mismatched_url"
    assert batch.errors.data[0].line == 2
    with pytest.raises(openai.BadRequestError):
        await client.batches.create(input_file_id=file.id, endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        await client.batches.create(input_file_id="file-0123", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=_jsonl([_chat_line(0)]), purpose="fine-tune")
    with pytest.raises(openai.AuthenticationError):
        await batch_gateway.openai("wrong").files.list()


@pytest.mark.parametrize("batch_gateway", [{"batch_max_file_bytes": 300, "batch_max_jobs": 1}], indirect=True)
async def test_file_size_and_job_limits(batch_gateway):
    client = batch_gateway.openai(KEY)
    with pytest.raises(openai.APIStatusError) as err:
        await client.files.create(file=_jsonl([_chat_line(i) for i in range(5)]), purpose="batch")
    assert err.value.status_code == 413
    batch_gateway.engine.token_delay_s = 0.2
    file = await client.files.create(file=_jsonl([_chat_line(0)]), purpose="batch")
    await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError):
        await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


async def test_a_line_that_cannot_be_recorded_fails_the_batch(batch_gateway, monkeypatch):
    from steploop.gateway.batch_api import durable

    def disk_full(self, record):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(durable.Journal, "append", disk_full)
    client = batch_gateway.openai(KEY)
    file = await client.files.create(file=_jsonl([_chat_line(i) for i in range(3)]), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    batch = await _until_done(client, batch.id)
    assert batch.status == "failed" and batch.errors.data[0].code == "internal_error"
