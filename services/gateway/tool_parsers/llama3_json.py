"""Llama 3.x JSON tool calls (vLLM's `--tool-call-parser llama3_json`): the reply is a JSON object naming the
function, optionally after Llama's `<|python_tag|>`, several separated by ";":

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}

A reply that begins with "{" is read as calls (as vLLM streams it); `<|python_tag|>` may also follow some text,
which is then the content. A reply that is not wholly such objects is content. "arguments" is accepted beside
"parameters".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers.base import ToolParser, listing

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()
_CALLS_FIRST = re.compile(r"\s*\{")     # matched at the start only: cheap on every streamed delta
_ONLY_SPACE = re.compile(r"\s*\Z")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = PYTHON_TAG

    def find_start(self, text: str, since: int = 0) -> int:
        if _CALLS_FIRST.match(text):
            return 0              # the whole reply is calls (whitespace before the "{" is not content)
        return text.find(PYTHON_TAG, since)

    def held_len(self, text: str) -> int:
        if _ONLY_SPACE.match(text):
            return len(text)      # only whitespace yet: the reply may still begin with "{"
        return super().held_len(text)

    def call_values(self, calls_text: str) -> list[Any] | None:
        return _objects(calls_text.removeprefix(PYTHON_TAG))

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call a function to answer the user. The functions you can call, in JSON:\n"
                f"{listing(tools)}\n\nTo call one, answer with only a JSON object in the format "
                '{"name": <function-name>, "parameters": <arguments-object>}; separate several calls with "; ".')

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)


def _objects(text: str) -> list[Any] | None:
    """`{...}; {...}` -> the objects; None if anything else is in the text."""
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        rest = text[pos:].lstrip()
        if not rest:
            return values
        if not rest.startswith(";"):
            return None
        if not rest[1:].strip():
            return values         # a trailing ";"
        pos = len(text) - len(rest) + 1
