"""OpenAI's Responses API through the official SDK against the real cluster and model: greedy text equals chat
completions' for the same conversation (create, stream, previous_response_id chaining), function calling, and
text.format json_schema parsed by responses.parse."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
INSTRUCTIONS = "You are a terse assistant."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_text(cluster, messages) -> str:
    r = client(cluster).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    return r.choices[0].message.content


def test_create_and_stream_equal_chat_completions(cluster):
    ask = "Name three primary colors."
    expected = chat_text(cluster, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ask}])
    r = client(cluster).responses.create(model=MODEL, input=ask, instructions=INSTRUCTIONS, temperature=0,
                                         max_output_tokens=MAX_TOKENS)
    assert r.output_text == expected
    with client(cluster).responses.stream(model=MODEL, input=ask, instructions=INSTRUCTIONS, temperature=0,
                                          max_output_tokens=MAX_TOKENS) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == expected


def test_previous_response_id_equals_the_whole_conversation(cluster):
    c = client(cluster)
    first = c.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=MAX_TOKENS)   # stored by default
    second = c.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                temperature=0, max_output_tokens=MAX_TOKENS)
    assert second.output_text == chat_text(cluster, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert c.responses.retrieve(second.id).output_text == second.output_text


def test_forced_function_call_validates(cluster):
    r = client(cluster).responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                         tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                         max_output_tokens=60)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client(cluster).responses.create(model=MODEL, tools=[WEATHER], temperature=0,
                                              max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output


class City(pydantic.BaseModel):
    name: str
    country: str


def test_parse_json_schema(cluster):
    r = client(cluster).responses.parse(model=MODEL, input="Give me a city in France as JSON.", text_format=City,
                                        temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, City) and r.output_parsed.name
