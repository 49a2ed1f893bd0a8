"""Llama 3.x JSON tool calls (vLLM's `--tool-call-parser llama3_json`): the reply is a JSON object naming the
function, optionally after Llama's `<|python_tag|>`, several separated by ";":

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}

A reply that begins with "{" is read as calls (as vLLM streams it); `<|python_tag|>` may also follow some text,
which is then the content. "arguments" is accepted beside "parameters".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers.base import Block, Schemas, ToolParser, listing
from steploop.gateway.tool_parsers.json_calls import read_call_list

PYTHON_TAG = "<|python_tag|>"
_CALLS_FIRST = re.compile(r"\s*\{")     # matched at the start only: cheap on every streamed delta


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def find_block(self, text: str, pos: int) -> int:
        if pos == 0 and _CALLS_FIRST.match(text):
            return 0              # the whole reply is calls (whitespace before the "{" is not content)
        return text.find(PYTHON_TAG, pos)

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        pos = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        return read_call_list(text, pos, final, tools, open_="", sep=";", close=None)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call a function to answer the user. The functions you can call, in JSON:\n"
                f"{listing(tools)}\n\nTo call one, answer with only a JSON object in the format "
                '{"name": <function-name>, "parameters": <arguments-object>}; separate several calls with "; ".')

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)
