"""Structured output: with response_format json_schema / json_object the output always parses and validates."""

from __future__ import annotations

import json

import pytest

from tests.integration.api_helpers import MODEL, client

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON.", "Invent a cat.", "Give me a record."]


def _validate(value, schema=SCHEMA) -> None:
    import jsonschema_rs
    jsonschema_rs.validate(schema, value)


def test_json_schema_output_always_validates(cluster):
    """Three seeded prompts at once (unstreamed) and one streamed: every output parses and validates."""
    import asyncio

    from tests.integration.api_helpers import aclient

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def kwargs(i, prompt):
        return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0.7, "seed": i,
                    "max_tokens": 64, "response_format": fmt}

    async def run_all():
        c = aclient(cluster)
        results = await asyncio.gather(*(c.chat.completions.create(**kwargs(i, p)) for i, p in enumerate(PROMPTS)))
        await c.close()
        return results

    for r in asyncio.run(run_all()):
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        _validate(json.loads(r.choices[0].message.content))
    text = "".join(c.choices[0].delta.content or "" for c in
                   client(cluster).chat.completions.create(**kwargs(9, PROMPTS[0]), stream=True) if c.choices)
    _validate(json.loads(text))


def test_json_object_parses(cluster):
    r = client(cluster).completions.create(model=MODEL, prompt="A JSON object about the moon:", temperature=0.7,
                                           seed=3, max_tokens=24, extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice,parallel", [("named", True), ("required", False), ("required", True)])
def test_forced_tool_calls_are_valid_calls(cluster, choice, parallel):
    """tool_choice naming a function, or "required": the real model's reply is constrained by the worker's grammar,
    so every call names a given tool and its arguments validate against that tool's schema. With parallel calls
    the small model may write calls until max_tokens: the calls it finished are still returned (finish "length")."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, CLOCK_TOOL)}
    finishes = {"stop"} if choice == "named" else {"tool_calls"} if not parallel else {"tool_calls", "length"}
    for seed in range(2):
        r = client(cluster).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What's the weather like in Lisbon?"}],
            tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice=tool_choice, temperature=0.8, seed=seed, max_tokens=96,
            parallel_tool_calls=parallel)
        message = r.choices[0].message
        assert r.choices[0].finish_reason in finishes, message
        if not parallel:
            assert len(message.tool_calls) == 1
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            _validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice == "named":
            assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_forced_call_to_a_tool_with_nested_definitions(cluster):
    """openai.pydantic_function_tool writes nested models as $defs + $ref; under "required" each tool's schema sits
    inside a combined one, and its refs must still resolve (they did not: the grammar fell back to any JSON)."""
    person = {"$defs": {"Addr": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 20},
                                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                 "required": ["street", "zip"], "additionalProperties": False}},
              "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "home": {"$ref": "#/$defs/Addr"}},
              "required": ["name", "home"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "Person", "parameters": person}}
    r = client(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Alice lives at 1 Main St, 12345."}], tools=[tool],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "Person"
    _validate(json.loads(call.function.arguments), person)
