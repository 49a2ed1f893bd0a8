"""Anthropic's Messages API through the official `anthropic` SDK, unchanged, against the fake engine (scripted
replies): the message and stream shapes, stop reasons, tools under each tool_choice, usage, and errors in
Anthropic's shape and status codes (raw HTTP where the shape itself is checked)."""

from __future__ import annotations

import json
from dataclasses import replace

import aiohttp
import anthropic
import grpc
import pytest

from steploop.gateway import errors
from tests.gateway.conftest import HERMES_CALL, REPLY_TEXT, SERVED_NAME, sent_prompt

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(gateway, api_key: str = "none") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key=api_key, max_retries=0)


async def post(gateway, path, body, headers=None):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}{path}", json=body, headers=headers or {}) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


def assert_anthropic_error(body, kind):
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]


async def test_create_text_with_system(gateway, tokenizer):
    gateway.engine.cached_tokens = 4
    m = await client(gateway).messages.create(model=SERVED_NAME, max_tokens=100, messages=ASK,
                                              system="You answer in French.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == SERVED_NAME
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == REPLY_TEXT
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt_len = len(gateway.engine.requests[-1].prompt_token_ids)
    assert m.usage.input_tokens == prompt_len - 4 and m.usage.cache_read_input_tokens == 4
    assert m.usage.output_tokens == len(gateway.engine.reply_ids)
    prompt = sent_prompt(gateway, tokenizer)
    assert "You answer in French." in prompt and "Weather in Paris?" in prompt
    assert gateway.engine.requests[-1].sampling.max_tokens == 100


async def test_system_blocks_and_sampling_reach_the_engine(gateway, tokenizer):
    # This SDK version dropped the sampling arguments from create(); clients send them in the body still.
    await client(gateway).messages.create(model=SERVED_NAME, max_tokens=5, messages=ASK,
                                          extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 7},
                                          system=[{"type": "text", "text": "Be brief."}])
    sampling = gateway.engine.requests[-1].sampling
    assert (round(sampling.temperature, 3), round(sampling.top_p, 3), sampling.top_k) == (0.3, 0.9, 7)
    assert "Be brief." in sent_prompt(gateway, tokenizer)


async def test_stop_sequence_and_max_tokens(gateway):
    m = await client(gateway).messages.create(model=SERVED_NAME, max_tokens=100, messages=ASK,
                                              stop_sequences=["世界", "never"])
    assert m.content[0].text == REPLY_TEXT[:REPLY_TEXT.index("世界")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "世界"
    m = await client(gateway).messages.create(model=SERVED_NAME, max_tokens=2, messages=ASK)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


async def sse_events(gateway, body) -> list[tuple[str, dict]]:
    """(event name, data) of a raw Messages stream (the SDK hides ping events)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/v1/messages", json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
    events = []
    for record in text.strip().split("\n\n"):
        name, data = record.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_stream_text_event_sequence(gateway):
    events = await sse_events(gateway, {"model": SERVED_NAME, "max_tokens": 100, "messages": ASK})
    kinds = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert "".join(d["delta"]["text"] for _, d in events[3:-3]) == REPLY_TEXT
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    async with client(gateway).messages.stream(model=SERVED_NAME, max_tokens=100, messages=ASK) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == REPLY_TEXT and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(gateway.engine.reply_ids)


async def test_stream_stop_sequence(gateway):
    async with client(gateway).messages.stream(model=SERVED_NAME, max_tokens=100, messages=ASK,
                                               stop_sequences=["世界"]) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == REPLY_TEXT[:REPLY_TEXT.index("世界")]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "世界"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_choice_tool_is_guided_and_a_tool_use_block(gateway, reply, stream):
    reply('{"city": "Paris"}')
    kwargs = {"model": SERVED_NAME, "max_tokens": 100, "messages": ASK, "tools": [WEATHER],
              "tool_choice": {"type": "tool", "name": "get_weather"}}
    if stream:
        async with client(gateway).messages.stream(**kwargs) as s:
            m = await s.get_final_message()
    else:
        m = await client(gateway).messages.create(**kwargs)
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    assert m.stop_reason == "tool_use"
    assert json.loads(gateway.engine.requests[-1].sampling.json_schema) == WEATHER["input_schema"]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_choice_any_is_guided(gateway, reply, stream):
    reply('[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    kwargs = {"model": SERVED_NAME, "max_tokens": 100, "messages": ASK, "tools": [WEATHER],
              "tool_choice": {"type": "any"}}
    if stream:
        async with client(gateway).messages.stream(**kwargs) as s:
            m = await s.get_final_message()
    else:
        m = await client(gateway).messages.create(**kwargs)
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Rome"})]
    assert m.stop_reason == "tool_use" and gateway.engine.requests[-1].sampling.json_schema


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_choice_auto_text_then_call(gateway, reply, tokenizer, stream):
    reply(HERMES_CALL)
    kwargs = {"model": SERVED_NAME, "max_tokens": 100, "messages": ASK, "tools": [WEATHER]}
    if stream:
        async with client(gateway).messages.stream(**kwargs) as s:
            m = await s.get_final_message()
    else:
        m = await client(gateway).messages.create(**kwargs)
    assert [b.type for b in m.content] == ["text", "tool_use"]
    # streamed, text goes out as it comes (up to the call's tag), as chat completions streams it
    assert m.content[0].text.strip() == "Let me check." and m.content[1].input == {"city": "Paris"}
    assert m.stop_reason == "tool_use" and gateway.engine.requests[-1].sampling.json_schema == ""
    assert "get_weather" in sent_prompt(gateway, tokenizer)


async def test_tool_choice_none_leaves_tools_out(gateway, tokenizer):
    m = await client(gateway).messages.create(model=SERVED_NAME, max_tokens=100, messages=ASK, tools=[WEATHER],
                                              tool_choice={"type": "none"})
    assert m.content[0].text == REPLY_TEXT and "get_weather" not in sent_prompt(gateway, tokenizer)


async def test_tool_result_turn_reaches_the_prompt(gateway, tokenizer):
    history = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "18C and sunny"}]}]}]
    m = await client(gateway).messages.create(model=SERVED_NAME, max_tokens=100, messages=history, tools=[WEATHER])
    assert m.content[0].text == REPLY_TEXT
    prompt = sent_prompt(gateway, tokenizer)
    assert '"city": "Paris"' in prompt and "18C and sunny" in prompt and "<tool_response>" in prompt


async def test_prefill_continues_the_assistant_turn(gateway, tokenizer):
    await client(gateway).messages.create(model=SERVED_NAME, max_tokens=5, messages=ASK + [
        {"role": "assistant", "content": "It is"}])
    assert sent_prompt(gateway, tokenizer).endswith("It is")


async def test_count_tokens_is_the_prompt_length(gateway):
    c = client(gateway)
    counted = await c.messages.count_tokens(model=SERVED_NAME, messages=ASK, system="Be brief.", tools=[WEATHER])
    await c.messages.create(model=SERVED_NAME, max_tokens=5, messages=ASK, system="Be brief.", tools=[WEATHER])
    assert counted.input_tokens == len(gateway.engine.requests[-1].prompt_token_ids)


@pytest.mark.parametrize("body, fragment", [
    ({"messages": ASK}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}, "image"),
    ({"messages": ASK, "max_tokens": 5, "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": []}], "max_tokens": 5}, "no content"),
    ({"messages": ASK, "max_tokens": 5, "stop_sequences": "x"}, "stop_sequences"),
    ({"messages": ASK, "max_tokens": 5, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"messages": ASK, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web"}]}, "server tools"),
])
async def test_bad_requests_are_anthropic_400s(gateway, body, fragment):
    status, resp, _ = await post(gateway, "/v1/messages", {"model": SERVED_NAME, **body})
    assert status == 400
    assert_anthropic_error(resp, "invalid_request_error")
    assert fragment in resp["error"]["message"]


async def test_sdk_exception_types(gateway):
    with pytest.raises(anthropic.BadRequestError):
        await client(gateway).messages.create(model=SERVED_NAME, max_tokens=5, messages=[])
    with pytest.raises(anthropic.NotFoundError):
        await client(gateway).messages.create(model="claude-nope", max_tokens=5, messages=ASK)
    status, resp, _ = await post(gateway, "/v1/nothing-here", {})   # other routes keep OpenAI's shape
    assert status == 404 and "error" in resp and "type" not in resp


@pytest.mark.parametrize("status, meta, http_status, exc", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ((errors.RETRY_AFTER_KEY, "3"),), 529, anthropic.OverloadedError),
    (grpc.StatusCode.UNAVAILABLE, (), 503, anthropic.ServiceUnavailableError),
    (grpc.StatusCode.INTERNAL, (), 500, anthropic.InternalServerError),
])
async def test_engine_errors_in_anthropic_statuses(gateway, status, meta, http_status, exc):
    gateway.engine.status, gateway.engine.status_metadata = status, meta
    for stream in (False, True):
        got, resp, headers = await post(gateway, "/v1/messages", {"model": SERVED_NAME, "max_tokens": 5,
                                                                  "messages": ASK, "stream": stream})
        assert got == http_status
        assert_anthropic_error(resp, "overloaded_error" if got == 529 else "api_error")
        if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert headers["Retry-After"] == "3"
    with pytest.raises(exc) as caught:
        await client(gateway).messages.create(model=SERVED_NAME, max_tokens=5, messages=ASK)
    assert caught.value.status_code == http_status


async def test_failure_mid_stream_is_an_error_event(gateway):
    gateway.engine.fail_after = 3
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/v1/messages", json={"model": SERVED_NAME, "max_tokens": 50,
                                                                 "messages": ASK, "stream": True}) as resp:
            assert resp.status == 200
            text = await resp.text()
    assert "event: message_start" in text and text.rstrip().splitlines()[-2] == "event: error"
    assert json.loads(text.rstrip().splitlines()[-1][len("data: "):])["error"]["type"] == "api_error"


@pytest.fixture
def gateway_config(gateway_config, request):
    key = getattr(request, "param", None)
    return replace(gateway_config, api_key=key) if key else gateway_config


@pytest.mark.parametrize("gateway_config", ["s3cret"], indirect=True)
async def test_x_api_key_and_authentication_error(gateway):
    m = await client(gateway, api_key="s3cret").messages.create(model=SERVED_NAME, max_tokens=5, messages=ASK)
    assert m.content[0].text
    with pytest.raises(anthropic.AuthenticationError):
        await client(gateway, api_key="wrong").messages.create(model=SERVED_NAME, max_tokens=5, messages=ASK)
    status, resp, _ = await post(gateway, "/v1/messages", {})
    assert status == 401
    assert_anthropic_error(resp, "authentication_error")
    r = await gateway.openai(api_key="s3cret").chat.completions.create(model=SERVED_NAME, messages=ASK)
    assert r.choices[0].message.content   # Bearer still works
