"""The gateway's engine link: every request on one Session stream, a broken stream fails only what was live on
it, and --no-engine-session falls back to one Generate call per request."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from steploop.common.engine_contract import EngineRequest
from steploop.common.sampling_params import SamplingParams
from steploop.gateway import errors
from steploop.gateway.app_keys import SERVING
from steploop.gateway.engine.engine_client import EngineClient
from tests.gateway.conftest import REPLY_TEXT, SERVED_NAME, wait_for
from tests.gateway.fake_engine import FakeEngine, start_fake_engine

CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]}


async def test_concurrent_requests_share_one_session(gateway):
    client = gateway.openai()
    replies = await asyncio.gather(*(client.chat.completions.create(**CHAT) for _ in range(8)))
    assert [r.choices[0].message.content for r in replies] == [REPLY_TEXT] * 8
    assert gateway.engine.sessions == 1 and len(gateway.engine.requests) == 8
    assert len({r.request_id for r in gateway.engine.requests}) == 8


async def test_a_live_request_id_is_refused_before_it_is_sent(gateway):
    client = gateway.app[SERVING].engine
    gateway.engine.token_delay_s = 0.05
    first = client.generate(EngineRequest("same", [1, 2], SamplingParams(max_tokens=3)))
    await anext(first)
    with pytest.raises(errors.APIError) as info:
        await anext(client.generate(EngineRequest("same", [1, 2], SamplingParams(max_tokens=3))))
    assert (info.value.status, info.value.code) == (400, "duplicate_request_id")
    assert [t async for c in first for t in c.token_ids]                  # the first one is unharmed
    assert [r.request_id for r in gateway.engine.requests] == ["same"]


async def test_a_broken_session_fails_its_live_requests_and_the_next_request_opens_a_new_one(gateway):
    gateway.engine.token_delay_s = 0.05
    gateway.engine.reply_fn = lambda req: [100 + i for i in range(200)]   # long, no EOS
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{gateway.url}/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: ")
        gateway.engine.drop_sessions()                     # the scheduler restarted, say
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    error = json.loads(events[-2][len(b"data: "):])["error"]
    assert events[-1].strip() == b"data: [DONE]"
    assert error["code"] == "engine_unavailable"
    gateway.engine.token_delay_s = 0.0
    gateway.engine.reply_fn = None
    reply = await gateway.openai().chat.completions.create(**CHAT)
    assert reply.choices[0].message.content == REPLY_TEXT
    assert gateway.engine.sessions == 2


async def test_without_session_each_request_is_its_own_call(reply_ids):
    engine = FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1], token_delay_s=0.02)
    server, address, _ = await start_fake_engine(engine)
    client = EngineClient(address, multiplex=False)
    try:
        whole = EngineRequest("whole", [1, 2, 3], SamplingParams(max_tokens=100))
        chunks = [c async for c in client.generate(whole)]
        assert [t for c in chunks for t in c.token_ids] == reply_ids
        stream = client.generate(EngineRequest("left", [1, 2, 3], SamplingParams(max_tokens=100)))
        await anext(stream)
        await stream.aclose()                              # the caller left: the call is cancelled
        await wait_for(lambda: engine.cancelled == ["left"])
        engine.status, engine.status_metadata = grpc.StatusCode.INVALID_ARGUMENT, (
            ("steploop-error-code", "context_length_exceeded"), ("steploop-error-param", "max_tokens"))
        with pytest.raises(errors.APIError) as info:
            await anext(client.generate(EngineRequest("bad", [1], SamplingParams(max_tokens=5))))
        assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded",
                                                                          "max_tokens")
        assert engine.sessions == 0
    finally:
        await client.close()
        await server.stop(None)
