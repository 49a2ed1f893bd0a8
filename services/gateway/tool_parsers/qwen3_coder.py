"""Qwen3-Coder's XML calls (vLLM's `--tool-call-parser qwen3_coder`; also Qwen3.5 and Qwen3-Next templates):

    Let me write it.
    <tool_call>
    <function=write_file>
    <parameter=path>
    /tmp/a.py
    </parameter>
    <parameter=content>
    print("hi")
    </parameter>
    </function>
    </tool_call>

Values are text: one newline after `<parameter=...>` and before `</parameter>` is layout; each value is converted by
the tool's schema (integers, numbers, booleans, objects and arrays; a string stays as written). A string value
streams as it is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers.base import Block, CallText, Schemas, ToolParser, held_prefix, listing
from steploop.gateway.tool_parsers.xml_params import Param, arguments_text

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_SPACE = re.compile(r"\s*")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = (CALL_OPEN, CALL_CLOSE)

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        pos = _skip(text, start + len(CALL_OPEN))
        if held_prefix(text, pos, FUNCTION):
            return Block("pending")
        name_end = text.find(">", pos + len(FUNCTION))
        if not text.startswith(FUNCTION, pos) or name_end < 0:
            return Block("pending") if text.startswith(FUNCTION, pos) else _content(text, start)
        name = text[pos + len(FUNCTION):name_end].strip()
        if name not in tools:
            return _content(text, start)
        params, pos, closed = _params(text, name_end + 1)
        call = CallText(name, arguments_text(params, tools[name], closed, PARAM_END, strip_newlines=True), closed)
        if not closed:     # at the reply's end, what follows the parameters read is content
            return Block("calls", pos if final else None, [call])
        after = _skip(text, pos)
        if text.startswith(CALL_CLOSE, after):
            return Block("calls", after + len(CALL_CLOSE), [call])
        if held_prefix(text, after, CALL_CLOSE) and not final:
            return Block("calls", None, [call])
        return Block("calls", pos, [call])

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions you can call, in "
                f"JSON:\n<tools>\n{listing(tools)}\n</tools>\n\nTo call a function, answer with:\n<tool_call>\n"
                "<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n"
                "</tool_call>")

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "\n".join(f"{CALL_OPEN}\n{FUNCTION}{c['name']}>\n" + "".join(
            f"{PARAM}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n{PARAM_END}\n"
            for k, v in c["arguments"].items()) + f"{FUNCTION_END}\n{CALL_CLOSE}" for c in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _skip(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


def _content(text: str, start: int) -> Block:
    found = text.find(CALL_CLOSE, start)
    return Block("content", found + len(CALL_CLOSE) if found >= 0 else None)


def _params(text: str, pos: int) -> tuple[list[Param], int, bool]:
    """The parameters from `pos`: (params, where reading stopped, whether </function> closed them)."""
    params: list[Param] = []
    while True:
        pos = _skip(text, pos)
        if text.startswith(FUNCTION_END, pos):
            return params, pos + len(FUNCTION_END), True
        if not text.startswith(PARAM, pos):
            return params, pos, False       # still arriving (or not the format: the call stays open)
        key_end = text.find(">", pos + len(PARAM))
        if key_end < 0:
            return params, pos, False
        key = text[pos + len(PARAM):key_end].strip()
        value_end = text.find(PARAM_END, key_end + 1)
        if value_end < 0:
            params.append(Param(key, text[key_end + 1:], False))
            return params, len(text), False
        params.append(Param(key, text[key_end + 1:value_end], True))
        pos = value_end + len(PARAM_END)
