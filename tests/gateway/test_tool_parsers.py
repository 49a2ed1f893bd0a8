"""Each --tool-call-parser format on its own: whole replies, the same replies streamed in small deltas (content
until the format's marker, calls at the end), and malformed output staying content."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from steploop.gateway.config import GatewayConfig
from steploop.gateway.text.chat_template import for_template
from steploop.gateway.tool_parsers import TOOL_PARSERS, ContentSplitter, get_tool_parser
from steploop.gateway.tool_parsers.tools import parse_tools

NAMES = {"get_weather", "get_time"}
PARIS = {"city": "Paris"}

# (parser, reply, expected content, expected calls as (name, arguments))
WHOLE = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Sure.", [("get_weather", PARIS)]),
    ("hermes", ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
               '"arguments": {"city": "Paris"}}</tool_call>'), None, [("get_time", {}), ("get_weather", PARIS)]),
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Checking.", [("get_weather", PARIS)]),
    ("mistral", ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": '
                '{"city": "Paris"}}]'), None, [("get_time", {}), ("get_weather", PARIS)]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}',     # v11+ tokenizers' spelling
     None, [("get_weather", PARIS), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", PARIS)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", PARIS)]),
    ("llama3_json", ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                    '"arguments": {"city": "Paris"}}'), None, [("get_time", {}), ("get_weather", PARIS)]),
    ("llama3_json", ' \n{"name": "get_time", "parameters": {}};', None, [("get_time", {})]),
    ("llama3_json", 'Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "Let me look.", [("get_weather", PARIS)]),
]

# Replies that must come back as content, whole and streamed.
MALFORMED = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("hermes", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'),            # not a given tool
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par'),       # cut short
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": "not an object"}]'),
    ("mistral", '[TOOL_CALLS]'),
    ("mistral", 'I would call [TOOL_CALLS] here, but no.'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and some prose'),
    ("llama3_json", '{"answer": 42}'),                                                   # JSON, but not a call
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci'),
    ("llama3_json", '<|python_tag|>print("hi")'),                                         # Llama's code tool
]

PLAIN = ["It is sunny in Paris.", "Use <b>bold</b> or [brackets] {like this} freely.", "ends on a brace {", ""]


def new_ids():
    counter = iter(range(1000))
    return lambda: f"id{next(counter)}"


def streamed(parser_name: str, text: str, step: int = 3) -> tuple[str, str, bool]:
    """Feeds `text` in deltas of `step` characters: (content sent while streaming, held at the end, in_calls)."""
    splitter = ContentSplitter(get_tool_parser(parser_name))
    sent = "".join(splitter.feed(text[i:i + step]) for i in range(0, len(text), step))
    return sent, splitter.held(), splitter.in_calls


@pytest.mark.parametrize("name, text, content, calls", WHOLE)
def test_whole_replies(name, text, content, calls):
    got_content, got = get_tool_parser(name).parse(text, NAMES, new_ids())
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert [c.id for c in got] == [f"id{i}" for i in range(len(calls))]


@pytest.mark.parametrize("step", [1, 2, 7])
@pytest.mark.parametrize("name, text, content, calls", WHOLE)
def test_streamed_content_stops_at_the_marker(name, text, content, calls, step):
    sent, held, in_calls = streamed(name, text, step)
    assert in_calls and sent + held == text
    assert sent.strip() == (content or "")       # no part of the marker or the calls leaked out as content
    _, got = get_tool_parser(name).parse(sent + held, NAMES, new_ids())
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_calls_stay_content(name, text):
    assert get_tool_parser(name).parse(text, NAMES, new_ids()) == (text, [])
    sent, held, _ = streamed(name, text)
    assert sent + held == text                   # streamed: the held part goes out as content at the end


@pytest.mark.parametrize("text", PLAIN)
@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_replies_stream_as_they_come(name, text):
    assert get_tool_parser(name).parse(text, NAMES, new_ids()) == (text, [])
    sent, held, in_calls = streamed(name, text)
    assert not in_calls and sent + held == text
    assert held == ""


def test_a_possible_marker_start_waits_for_the_next_delta():
    splitter = ContentSplitter(get_tool_parser("mistral"))
    assert splitter.feed("Hi [TOOL") == "Hi " and splitter.feed("_CALLS]") == "" and splitter.in_calls
    splitter = ContentSplitter(get_tool_parser("mistral"))
    assert splitter.feed("a [TO") == "a " and splitter.feed("P]") == "[TOP]"
    splitter = ContentSplitter(get_tool_parser("llama3_json"))
    assert splitter.feed("  \n") == "" and splitter.feed('{"name"') == "" and splitter.in_calls
    splitter = ContentSplitter(get_tool_parser("llama3_json"))
    assert splitter.feed(" Hi <|python") == " Hi " and splitter.feed("_tag|>{") == "" and splitter.in_calls


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
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, mistral, llama3_json"):
        GatewayConfig(tool_call_parser="pythonic")
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
