"""Model replies in every --tool-call-parser format, with the content and calls each must read as: the shared data
of the conformance suite (test_tool_parser_conformance.py) and the SDK streaming test."""

from __future__ import annotations

import json
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
    "get_time": {"type": "object", "properties": {}},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
    "count": {"type": "object", "properties": {"n": {"type": "integer"}, "ratio": {"type": "number"},
                                               "flag": {"type": "boolean"}, "tags": {"type": "array"}}},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]

PARIS = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})
CODE = 'def f(x):\n    return "ok" if x else \'no\'  # 你好 🎉\n' * 3
WRITE = ("write_file", {"path": "/tmp/a.py", "content": CODE})
COUNT = ("count", {"n": 3, "ratio": 0.5, "flag": True, "tags": ["a", "b"]})

PLAIN = ["It is sunny in Paris.", "Use <b>bold</b> or [brackets] {like this} freely; a < b.", "你好，世界 🎉🚀",
         "ends on a brace {", "  padded  \n"]


def js(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def hermes(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {js(a)}}}\n</tool_call>' for n, a in calls)


# parser -> [(reply, content, [(name, arguments)])]
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]]] = {
    "hermes": [
        ("Sure.\n" + hermes(PARIS), "Sure.", [PARIS]),
        (hermes(TIME, PARIS), None, [TIME, PARIS]),
        (hermes(WRITE, COUNT), None, [WRITE, COUNT]),
        ('<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>', None, [PARIS]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),   # no close tag
        ("Let me see. " + hermes(PARIS) + "\nDone.", "Let me see.Done.", [PARIS]),
        ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),                       # not a given tool
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ],
    "mistral": [
        ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Checking.", [PARIS]),
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "write_file", "arguments": '
         + js(WRITE[1]) + "}]", None, [TIME, WRITE]),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}', None, [PARIS, TIME]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [PARIS]),
        ("I would call [TOOL_CALLS] here, but no.", "I would call [TOOL_CALLS] here, but no.", []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "count", "arguments": '
         + js(COUNT[1]) + "}", None, [TIME, COUNT]),
        (' \n{"name": "get_time", "parameters": {}};', None, [TIME]),
        ('Let me look.<|python_tag|>{"name": "write_file", "parameters": ' + js(WRITE[1]) + "}",
         "Let me look.", [WRITE]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ],
}
