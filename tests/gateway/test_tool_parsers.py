"""Each --tool-call-parser format on its own: markers held back while streaming, call ids, how each format is taught
to templates without tools (their replies, whole and streamed, are the conformance suite's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from steploop.gateway.config import GatewayConfig
from steploop.gateway.text.chat_template import for_template
from steploop.gateway.tool_parsers import CallSplitter, get_tool_parser
from steploop.gateway.tool_parsers.json_text import JsonNormalizer, normalized
from steploop.gateway.tool_parsers.tools import parse_tools

SCHEMAS = {"get_weather": {"type": "object"}, "get_time": {"type": "object"}}
PARIS = {"city": "Paris"}


def feeds(parser_name: str, deltas: list[str]) -> list[list[dict]]:
    splitter = CallSplitter(get_tool_parser(parser_name), SCHEMAS, lambda: "id")
    return [splitter.feed(d) for d in deltas] + [splitter.finish()]


def test_a_possible_marker_start_waits_for_the_next_delta():
    call = {"tool_calls": [{"index": 0, "id": "id", "type": "function",
                            "function": {"name": "get_time", "arguments": ""}}]}
    assert feeds("mistral", ["Hi [TOOL", "_CALLS]", 'get_time{}']) == [
        [{"content": "Hi"}], [], [call, {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}], []]
    assert feeds("mistral", ["a [TO", "P]"]) == [[{"content": "a"}], [{"content": " [TOP]"}], []]
    assert feeds("llama3_json", ["  \n", '{"name"', ': "get_time"'])[:2] == [[], []]
    assert feeds("llama3_json", [" Hi <|python", "_tag|>{"])[:2] == [[{"content": " Hi"}], []]


def test_mistral_call_ids_are_what_its_templates_accept():
    mistral = get_tool_parser("mistral")
    ids = {mistral.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert mistral.template_call_id("call_0123456789abcdef") == "789abcdef"
    assert mistral.template_call_id("x-1") == "0000000x1" and mistral.template_call_id("AbC123xyZ") == "AbC123xyZ"
    assert get_tool_parser("hermes").template_call_id("call_1") == "call_1"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                               "function": {"name": "get_weather",
                                                                            "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "21"}]


@pytest.mark.parametrize("name, call, result, teaches", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "<tool_response>\n21\n</tool_response>", "<tool_call>"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "[TOOL_RESULTS]21[/TOOL_RESULTS]", "[TOOL_CALLS]"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "The function returned:\n21",
     '"parameters"'),
])
def test_templates_without_tools_get_the_format_in_words(name, call, result, teaches):
    parser = get_tool_parser(name)
    request = parse_tools({"tools": [WEATHER]}, "", parser)
    out, tools = for_template(TURNS, request, parser, native=False)
    assert tools is None and out[0]["role"] == "system"
    assert teaches in out[0]["content"] and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call}
    assert out[3] == {"role": "user", "content": result}


def test_native_mistral_templates_get_matching_nine_character_ids():
    parser = get_tool_parser("mistral")
    out, tools = for_template(TURNS, parse_tools({"tools": [WEATHER]}, "", parser), parser, native=True)
    assert [t["function"]["name"] for t in tools] == ["get_weather"]
    assert out[1]["tool_calls"][0]["id"] == out[2]["tool_call_id"] == "789abcdef"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == PARIS


def test_the_flag_names_a_known_parser():
    assert GatewayConfig().tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, mistral, llama3_json, "
                                         "qwen3_coder, pythonic, deepseek_v3, kimi_k2, glm45, granite, openai"):
        GatewayConfig(tool_call_parser="xlam")
    with pytest.raises(ValueError, match="llama3_json"):
        get_tool_parser("nope")


def test_the_tokenizer_imports_no_tool_code():
    """The tokenizer renders messages it is given (chat_template.py prepares them): no tool module behind it."""
    code = ("import sys, steploop.gateway.text.tokenizer; "
            "print(' '.join(m for m in sys.modules if m.startswith('steploop.gateway.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = out.stdout.split()
    assert "steploop.gateway.text.tokenizer" in loaded
    assert not [m for m in loaded if "tool" in m or "chat_template" in m], loaded


@pytest.mark.parametrize("raw", [
    '{"city": "Paris"}', '{ "a" :1.50,"b":[1,2 , {"c":null}],"d":true, "e":"x\\"y\\n\\u00e9\\ud83d\\ude80z"}',
    "{}", "[]", '{"a": []}', '{"n": -0.5e3, "m": 12, "big": 12345678901234567890}', '"str"', "42"])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_arguments_are_written_as_json_dumps_writes_them_however_they_arrive(raw, step):
    norm, out = JsonNormalizer(), ""
    for i in range(0, len(raw), step):
        out += norm.feed_to(raw[:i + step])
    assert out + norm.finish() == json.dumps(json.loads(raw), ensure_ascii=False)


def test_arguments_stop_where_they_stop_being_json():
    assert normalized('{"a": 1.') == '{"a": ' and normalized('{"a": "x') == '{"a": "x'
    assert normalized('{"a" 1}') == '{"a"' and normalized('{"k": "\\ud800x"}') == '{"k": "\\ud800x"}'
    norm = JsonNormalizer()
    assert norm.feed_to('{"n": 12') == '{"n": ' and norm.feed_to('{"n": 123') == ""   # a number waits for its end
    assert norm.feed_to('{"n": 123}') == "123}"
