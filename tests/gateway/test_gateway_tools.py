"""Tool calling through the official SDK, against the fake engine (scripted replies): what reaches the engine
(prompt with the tools, the grammar of a forced call) and what the client gets (tool_calls, streamed or not)."""

from __future__ import annotations

import json

import openai
import pytest

from steploop.gateway.text.chat_template import for_template
from steploop.gateway.tool_parsers import get_tool_parser
from steploop.gateway.tool_parsers.tools import Tool, ToolRequest, parse_tools
from tests.gateway.conftest import HERMES_CALL, SERVED_NAME, sent_prompt, streamed_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = get_tool_parser("hermes")


async def test_auto_call_unstreamed(gateway, tokenizer, reply):
    reply(HERMES_CALL)
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER, TIME])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = sent_prompt(gateway, tokenizer)   # SmolLM2's template knows no tools: a system message lists them
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    assert "You are a helpful AI assistant named SmolLM" not in prompt   # our system message replaced the default
    assert gateway.engine.requests[-1].sampling.json_schema == ""       # auto: nothing constrains the reply


async def test_auto_call_streamed(gateway, reply):
    reply(HERMES_CALL)
    stream = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER],
                                                            stream=True)
    chunks = [c async for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = streamed_calls(chunks)
    assert content == "Let me check." and "<tool" not in content
    assert len(calls) == 1 and calls[0]["id"].startswith("call_") and calls[0]["pieces"] > 1   # arguments stream
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_plain_answer_stays_content(gateway, reply, stream):
    reply("It is sunny <b>today</b>.")
    kwargs = {"model": SERVED_NAME, "messages": ASK, "tools": [WEATHER]}
    if stream:
        chunks = [c async for c in await gateway.openai().chat.completions.create(**kwargs, stream=True)]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = await gateway.openai().chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert not r.choices[0].message.tool_calls
    assert text == "It is sunny <b>today</b>." and finish == "stop"


async def test_unparsable_call_is_returned_as_text(gateway, reply):
    bad = '<tool_call>\n{"name": "launch", "arguments": {"city": \n</tool_call>'     # not a given tool
    reply(bad)
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    chunks = [c async for c in await gateway.openai().chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=[WEATHER], stream=True)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == bad


async def test_a_call_cut_short_keeps_its_arguments_as_far_as_written(gateway, reply):
    """Once its name is known a call has begun (its arguments already stream), so malformed arguments end it where
    they stop being JSON, as a call cut by max_tokens: the same streamed and whole."""
    reply('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>')
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER])
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": ')
    chunks = [c async for c in await gateway.openai().chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=[WEATHER], stream=True)]
    assert [(c["name"], c["arguments"]) for c in streamed_calls(chunks)] == [("get_weather", '{"city": ')]


@pytest.mark.parametrize("stream", [False, True])
async def test_named_tool_choice_is_constrained_to_its_arguments(gateway, reply, stream):
    reply('{"city": "Oslo", "unit": "c"}')
    kwargs = {"model": SERVED_NAME, "messages": ASK, "tools": [WEATHER, TIME],
                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if stream:
        chunks = [c async for c in await gateway.openai().chat.completions.create(**kwargs, stream=True)]
        deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
        assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
        assert all(d.index == 0 for d in deltas) and len(deltas) > 2   # the arguments stream as they are written
        arguments = "".join(d.function.arguments or "" for d in deltas)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = await gateway.openai().chat.completions.create(**kwargs)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].message.content is None
        arguments, finish = call.function.arguments, r.choices[0].finish_reason
    assert json.loads(arguments) == {"city": "Oslo", "unit": "c"} and finish == "stop"
    sent = gateway.engine.requests[-1].sampling
    assert json.loads(sent.json_schema) == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("stream", [False, True])
async def test_required_tool_choice(gateway, reply, stream):
    reply('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]')
    kwargs = {"model": SERVED_NAME, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}
    if stream:
        chunks = [c async for c in await gateway.openai().chat.completions.create(**kwargs, stream=True)]
        calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = await gateway.openai().chat.completions.create(**kwargs)
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2 and finish == "tool_calls"
    schema = json.loads(gateway.engine.requests[-1].sampling.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]] == ["get_weather", "get_time"]


async def test_no_parallel_calls_keeps_the_first(gateway, reply):
    reply(HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER, TIME],
                                                       parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER, TIME],
                                                       tool_choice="required", parallel_tool_calls=False)
    assert json.loads(gateway.engine.requests[-1].sampling.json_schema)["maxItems"] == 1


async def test_tool_choice_none_leaves_tools_out(gateway, tokenizer, reply):
    reply(HERMES_CALL)
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[WEATHER],
                                                       tool_choice="none")
    assert r.choices[0].message.content == HERMES_CALL and not r.choices[0].message.tool_calls
    assert "<tools>" not in sent_prompt(gateway, tokenizer)


async def test_conversation_with_earlier_calls_and_results(gateway, tokenizer, reply):
    """The second turn of a tool loop, as the SDK sends it: the assistant's calls (content null) and the result."""
    reply("It is 21 degrees in Paris.")
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    r = await gateway.openai().chat.completions.create(model=SERVED_NAME, messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 21 degrees in Paris." and r.choices[0].finish_reason == "stop"
    prompt = sent_prompt(gateway, tokenizer)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
    status, body = await post_tokenize(gateway, {"model": SERVED_NAME, "messages": messages, "tools": [WEATHER]})
    assert status == 200 and body["count"] == len(gateway.engine.requests[-1].prompt_token_ids)


async def post_tokenize(gateway, body):
    import aiohttp
    async with aiohttp.ClientSession() as session, session.post(f"{gateway.url}/tokenize", json=body) as resp:
        return resp.status, await resp.json()


BAD = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wizard"}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/a"}}}}}}, "response_format"),
    ({"extra_body": {"min_tokens": 5_000_000}}, "min_tokens"),   # max_tokens implicit (what fits): still bounded
    ({"messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "messages"),
]


@pytest.mark.parametrize("extra,param", BAD)
async def test_bad_tool_requests_are_400_naming_the_field(gateway, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        await gateway.openai().chat.completions.create(model=SERVED_NAME, **{"messages": ASK, **extra})
    assert info.value.body["param"] == param, info.value.body


def parse_hermes(text: str, names: set[str]):
    request = ToolRequest(tuple(Tool(n, "", {"type": "object"}) for n in sorted(names)), "auto", HERMES)
    return request.parse(text)


def test_hermes_parser_edge_cases():
    names = {"get_weather", "get_time"}
    content, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}', names)   # no closing tag
    assert content is None and [c.name for c in calls] == ["get_time"]
    text = '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'
    assert parse_hermes(text, names) == (text, [])                     # an unknown function: not a call
    content, calls = parse_hermes('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
                                  '</tool_call>', names)                # arguments given as a JSON string
    assert json.loads(calls[0].arguments) == {"city": "Rome"}
    assert ToolRequest((), "auto", HERMES).finish_reason([], "stop") == "stop"


def test_streamed_content_holds_a_possible_tag_start():
    s = parse_tools({"tools": [WEATHER]}, "", HERMES).splitter()
    assert [s.feed(d) for d in ["Hi <to", "ol_c", "all>", '{"x"', "}"]] == [[{"content": "Hi"}], [], [], [], []]
    assert s.finish() == [{"content": ' <tool_call>{"x"}'}]              # not a call after all: content
    s = parse_tools({"tools": [WEATHER]}, "", HERMES).splitter()
    assert s.feed("a <b") == [{"content": "a <b"}] and s.feed(" <t") == [] and s.feed("able>") == [
        {"content": " <table>"}]
    s = parse_tools({"tools": [WEATHER]}, "", HERMES).splitter()
    assert s.feed("ends with <tool") == [{"content": "ends with"}] and s.finish() == [{"content": " <tool"}]


def test_templates_that_know_tools_get_them_as_hf_expects():
    """A template that renders tools itself gets the tool list and the calls' arguments as objects."""
    request = parse_tools({"tools": [WEATHER]}, "", HERMES)
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    out, tools = for_template(messages, request, HERMES, native=True)
    assert tools == [WEATHER]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[2] == messages[2] and out[0] == ASK[0]
    plain, none = for_template(messages, None, HERMES, native=False)   # tool_choice none: no tool list, history kept
    assert none is None and plain[0] == ASK[0] and "<tool_call>" in plain[1]["content"]


def test_required_reply_cut_by_max_tokens_keeps_its_whole_calls():
    request = ToolRequest(tuple(parse_tools_for_test()), "required", HERMES)
    content, calls = request.parse('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "argu')
    assert content is None and [c.name for c in calls] == ["get_time"]
    assert request.finish_reason(calls, "length") == "length"
    # the call being written when max_tokens hit, as OpenAI returns one: its name, its arguments so far
    content, calls = request.parse('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", "{}"), ("get_weather", '{"ci')]
    assert request.parse('[{"name": "get_wea') == ('[{"name": "get_wea', [])   # not even a name: the text


PERSON = {"type": "function", "function": {"name": "Person", "parameters": {   # what openai.pydantic_function_tool
    "$defs": {"Addr": {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"],
                       "additionalProperties": False}},                      # writes for a nested model
    "type": "object", "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Addr"}},
    "required": ["name", "home"], "additionalProperties": False}}}


def test_required_schema_keeps_each_tools_refs_resolvable():
    import jsonschema

    schema = json.loads(parse_tools({"tools": [WEATHER, PERSON], "tool_choice": "required"}, "",
                                    HERMES).guided_schema())
    good = [{"name": "Person", "arguments": {"name": "Al", "home": {"street": "Main"}}},
            {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)         # refs resolve: "#/$defs/tool_1/$defs/Addr"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "Person", "arguments": {"name": "Al", "home": {"street": 5}}}], schema)


async def test_streamed_reply_with_tools_starts_with_null_content(gateway, reply):
    reply('{"city": "Oslo"}')
    chunks = [c async for c in await gateway.openai().chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None


def parse_tools_for_test():
    return parse_tools({"tools": [WEATHER, TIME]}, "", HERMES).tools
