"""OpenAI's Responses API through the official `openai` SDK against the fake engine (scripted replies): the
Response object and event stream, function calling, text.format, the store (previous_response_id, GET, DELETE,
eviction) and errors in OpenAI's shape."""

from __future__ import annotations

import json

import aiohttp
import openai
import pydantic
import pytest

from steploop.gateway.errors import APIError
from steploop.gateway.responses_api.store import ResponseStore
from tests.gateway.conftest import HERMES_CALL, REPLY_TEXT, SERVED_NAME, sent_prompt

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


async def test_create_text(gateway, tokenizer):
    gateway.engine.cached_tokens = 3
    r = await gateway.openai().responses.create(model=SERVED_NAME, input="Hi there", instructions="Be kind.",
                                                max_output_tokens=100, temperature=0.5)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == REPLY_TEXT and r.output[0].type == "message" and r.output[0].role == "assistant"
    prompt_len = len(gateway.engine.requests[-1].prompt_token_ids)
    assert r.usage.input_tokens == prompt_len and r.usage.input_tokens_details.cached_tokens == 3
    assert r.usage.output_tokens == len(gateway.engine.reply_ids) and r.store is True
    assert r.instructions == "Be kind." and r.max_output_tokens == 100
    prompt = sent_prompt(gateway, tokenizer)
    assert "Be kind." in prompt and "Hi there" in prompt
    assert round(gateway.engine.requests[-1].sampling.temperature, 3) == 0.5


async def test_max_output_tokens_is_incomplete(gateway):
    r = await gateway.openai().responses.create(model=SERVED_NAME, input="Hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


async def test_stream_event_sequence(gateway):
    async with gateway.openai().responses.stream(model=SERVED_NAME, input="Hi") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert final.output_text == REPLY_TEXT and final.status == "completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


@pytest.mark.parametrize("stream", [False, True])
async def test_function_call_auto(gateway, reply, tokenizer, stream):
    reply(HERMES_CALL)
    kwargs = {"model": SERVED_NAME, "input": "Weather in Paris?", "tools": [WEATHER]}
    if stream:
        async with gateway.openai().responses.stream(**kwargs) as s:
            r = await s.get_final_response()
    else:
        r = await gateway.openai().responses.create(**kwargs)
    assert [o.type for o in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and "get_weather" in sent_prompt(gateway, tokenizer)


async def test_named_function_is_guided_and_streams_arguments(gateway, reply):
    reply('{"city": "Oslo"}')
    async with gateway.openai().responses.stream(model=SERVED_NAME, input="Weather?", tools=[WEATHER],
                                                 tool_choice={"type": "function", "name": "get_weather"}) as s:
        kinds = [e.type async for e in s]
        r = await s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    [call] = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Oslo"}
    assert json.loads(gateway.engine.requests[-1].sampling.json_schema) == WEATHER["parameters"]


async def test_function_call_output_reaches_the_prompt(gateway, tokenizer):
    r = await gateway.openai().responses.create(model=SERVED_NAME, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}])
    assert r.output_text == REPLY_TEXT
    prompt = sent_prompt(gateway, tokenizer)
    assert '"city": "Paris"' in prompt and "18C and sunny" in prompt


class Weather(pydantic.BaseModel):
    city: str
    degrees: int


async def test_parse_json_schema(gateway, reply):
    reply('{"city": "Paris", "degrees": 18}')
    r = await gateway.openai().responses.parse(model=SERVED_NAME, input="Weather?", text_format=Weather)
    assert r.output_parsed == Weather(city="Paris", degrees=18)
    schema = json.loads(gateway.engine.requests[-1].sampling.json_schema)
    assert schema["properties"].keys() == {"city", "degrees"}
    await gateway.openai().responses.create(model=SERVED_NAME, input="JSON please",
                                            text={"format": {"type": "json_object"}})
    assert gateway.engine.requests[-1].sampling.json_object


async def test_previous_response_id_chains_and_get_delete(gateway, tokenizer):
    c = gateway.openai()
    first = await c.responses.create(model=SERVED_NAME, input="My name is Ada.")       # stored by default
    second = await c.responses.create(model=SERVED_NAME, input="What is my name?", previous_response_id=first.id)
    prompt = sent_prompt(gateway, tokenizer)
    assert "My name is Ada." in prompt and REPLY_TEXT in prompt and "What is my name?" in prompt
    assert second.previous_response_id == first.id and second.store is True
    got = await c.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == REPLY_TEXT
    await c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await c.responses.retrieve(second.id)
    assert "was deleted" in caught.value.body["message"]
    for gone in (second.id, "resp_nope"):       # deleting what is not there: a 404 with its reason, never a 500
        with pytest.raises(openai.NotFoundError) as caught:
            await c.responses.delete(gone)
        assert ("was deleted" if gone == second.id else "never created") in caught.value.body["message"]
    unstored = await c.responses.create(model=SERVED_NAME, input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        await c.responses.create(model=SERVED_NAME, input="Again", previous_response_id=unstored.id)
    assert caught.value.body["param"] == "previous_response_id"
    assert "'store': false" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        await c.responses.create(model=SERVED_NAME, input="Again", previous_response_id="resp_nope")
    assert "never created by this gateway" in caught.value.body["message"]


async def test_streamed_responses_are_stored_by_default(gateway):
    c = gateway.openai()
    async with c.responses.stream(model=SERVED_NAME, input="Hi") as stream:
        final = await stream.get_final_response()
    assert final.store is True and (await c.responses.retrieve(final.id)).output_text == REPLY_TEXT


def _why_missing(store: ResponseStore, response_id: str) -> str:
    with pytest.raises(APIError) as caught:
        store.get(response_id, "previous_response_id")
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"
    return caught.value.message


def test_store_evicts_oldest_and_expired_and_says_so():
    now = [0.0]
    store = ResponseStore(max_stored=2, ttl_s=10.0, clock=lambda: now[0], forgotten_kept=3)
    for name in ("a", "b", "c"):
        store.put({"id": name}, ())
    assert "evicted" in _why_missing(store, "a") and "2 most recent" in _why_missing(store, "a")
    assert store.get("b").response == {"id": "b"}
    now[0] = 11.0
    assert "expired" in _why_missing(store, "c") and "10 s" in _why_missing(store, "c")
    store.not_stored("d")
    assert "'store': false" in _why_missing(store, "d")
    assert "never created" in _why_missing(store, "a")     # reasons are bounded too: the oldest is forgotten


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
])
async def test_bad_requests_are_openai_400s(gateway, body, param):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/v1/responses", json={"model": SERVED_NAME, **body}) as resp:
            status, got = resp.status, await resp.json()
    assert status == 400 and got["error"]["param"] == param and got["error"]["message"], got
