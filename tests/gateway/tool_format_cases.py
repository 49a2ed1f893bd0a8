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


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def qwen3_coder(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join("<tool_call>\n<function=" + n + ">\n" + "".join(
        f"<parameter={k}>\n{_value(v)}\n</parameter>\n" for k, v in a.items()) + "</function>\n</tool_call>"
        for n, a in calls)


def glm45(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(f"<tool_call>{n}\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{_value(v)}</arg_value>\n" for k, v in a.items()) + "</tool_call>"
        for n, a in calls)


def deepseek_v3(*calls: tuple[str, dict[str, Any]]) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{js(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    ) + "<｜tool▁calls▁end｜>"


def kimi_k2(*calls: tuple[str, dict[str, Any]]) -> str:
    return "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{js(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>"


def granite(*calls: tuple[str, dict[str, Any]], marker: str = "<|tool_call|>") -> str:
    return marker + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def pythonic(*calls: tuple[str, dict[str, Any]]) -> str:
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def harmony(*calls: tuple[str, dict[str, Any]]) -> str:
    return "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{js(a)}"
                   "<|call|>" for n, a in calls)


CASES.update({
    "qwen3_coder": [
        ("I will write it.\n" + qwen3_coder(WRITE), "I will write it.", [WRITE]),
        (qwen3_coder(PARIS, TIME), None, [PARIS, TIME]),
        (qwen3_coder(COUNT), None, [COUNT]),
        ("<tool_call>\n<function=launch>\n</function>\n</tool_call>",
         "<tool_call>\n<function=launch>\n</function>\n</tool_call>", []),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>", None, [PARIS]),
    ],
    "glm45": [
        ("Let me check.\n" + glm45(PARIS), "Let me check.", [PARIS]),
        (glm45(WRITE, COUNT), None, [WRITE, COUNT]),
        ("<tool_call>get_time\n</tool_call>", None, [TIME]),
        ("<tool_call>get_time</tool_call>", None, [TIME]),
        ("<tool_call>launch\n</tool_call> then", "<tool_call>launch\n</tool_call> then", []),
    ],
    "deepseek_v3": [
        ("Checking the weather." + deepseek_v3(PARIS), "Checking the weather.", [PARIS]),
        (deepseek_v3(TIME, WRITE, COUNT), None, [TIME, WRITE, COUNT]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>launch\n```json\n{}\n```<｜tool▁call▁end｜>",
         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>launch\n```json\n{}\n```<｜tool▁call▁end｜>", []),
    ],
    "kimi_k2": [
        ("Sure." + kimi_k2(PARIS), "Sure.", [PARIS]),
        (kimi_k2(TIME, WRITE, COUNT), None, [TIME, WRITE, COUNT]),
        ("<|tool_call_begin|>functions.launch:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
         "<|tool_call_begin|>functions.launch:0<|tool_call_argument_begin|>{}<|tool_call_end|>", []),
    ],
    "granite": [
        (granite(PARIS), None, [PARIS]),
        (granite(TIME, WRITE, marker="<tool_call>"), None, [TIME, WRITE]),
        (" " + granite(COUNT, marker=""), None, [COUNT]),
        ('[1, 2] are numbers', '[1, 2] are numbers', []),
        ('<|tool_call|>[{"name": "launch", "arguments": {}}]', '<|tool_call|>[{"name": "launch", "arguments": {}}]',
         []),
    ],
    "pythonic": [
        (pythonic(PARIS), None, [PARIS]),
        (pythonic(TIME, WRITE, COUNT), None, [TIME, WRITE, COUNT]),
        ("<|python_start|>" + pythonic(PARIS) + "<|python_end|>", None, [PARIS]),
        ('[get_weather(city="Paris")] Done.', "Done.", [PARIS]),
        ("[launch(when='now')]", "[launch(when='now')]", []),
        ("[1, 2] are numbers", "[1, 2] are numbers", []),
    ],
    "openai": [
        ("<|channel|>final<|message|>Let me check.<|end|>" + harmony(PARIS), "Let me check.", [PARIS]),
        ("<|channel|>analysis<|message|>Need the time.<|end|>" + harmony(TIME, WRITE), "Need the time.",
         [TIME, WRITE]),
        ("<|channel|>commentary to=functions.count <|constrain|>json<|message|>" + js(COUNT[1]) + "<|call|>", None,
         [COUNT]),
        ("<|channel|>final<|message|>It is sunny.<|return|>", "It is sunny.", []),
    ],
})
