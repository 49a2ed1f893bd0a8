"""GLM-4.5 / 4.6 / 4.7's calls (vLLM's `--tool-call-parser glm45`): the function name, then key and value tags:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value whose schema type is string stays as written (and streams as written); others are read as JSON (or a
Python literal), else kept as text, as vLLM's glm4_moe parser does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers.base import Block, CallText, Schemas, ToolParser, listing
from steploop.gateway.tool_parsers.xml_params import Param, arguments_text

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_NAME_END = re.compile(r"\n|<arg_key>|</tool_call>")
_SPACE = re.compile(r"\s*")


class Glm45Parser(ToolParser):
    name = "glm45"
    markers = (CALL_OPEN, CALL_CLOSE)

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        pos = start + len(CALL_OPEN)
        name_end = _NAME_END.search(text, pos)
        if name_end is None:
            return Block("pending")
        name = text[pos:name_end.start()].strip()
        if name not in tools:
            found = text.find(CALL_CLOSE, start)
            return Block("content", found + len(CALL_CLOSE) if found >= 0 else None)
        params, pos, closed = _params(text, name_end.start())
        call = CallText(name, arguments_text(params, tools[name], closed, VALUE_END, strip_newlines=False), closed)
        return Block("calls", pos if closed or final else None, [call])   # at the end, the rest is content

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions you can call, in "
                f"JSON:\n<tools>\n{listing(tools)}\n</tools>\n\nFor each function call, answer with:\n<tool_call>"
                "{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n"
                "</tool_call>")

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "\n".join(f"{CALL_OPEN}{c['name']}\n" + "".join(
            f"{KEY}{k}{KEY_END}\n{VALUE}{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{VALUE_END}\n"
            for k, v in c["arguments"].items()) + CALL_CLOSE for c in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _params(text: str, pos: int) -> tuple[list[Param], int, bool]:
    """Key/value pairs from `pos`: (params, where reading stopped, whether </tool_call> closed them)."""
    params: list[Param] = []
    while True:
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if text.startswith(CALL_CLOSE, pos):
            return params, pos + len(CALL_CLOSE), True
        if not text.startswith(KEY, pos):
            return params, pos, False
        key_end = text.find(KEY_END, pos)
        if key_end < 0:
            return params, pos, False
        value_at = _SPACE.match(text, key_end + len(KEY_END)).end()  # type: ignore[union-attr]
        if not text.startswith(VALUE, value_at):
            return params, pos, False
        key = text[pos + len(KEY):key_end].strip()
        start = value_at + len(VALUE)
        end = text.find(VALUE_END, start)
        if end < 0:
            params.append(Param(key, text[start:], False))
            return params, len(text), False
        params.append(Param(key, text[start:end], True))
        pos = end + len(VALUE_END)
