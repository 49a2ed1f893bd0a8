"""Python-call tool calls (vLLM's `--tool-call-parser pythonic`: Llama 3.2 / 3.3 / 4, ToolACE): the reply is a
Python list of calls with keyword arguments of literal values, Llama 4 between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris"), get_time()]

As vLLM's parser, calls are read only at the start of the reply. Each argument is a Python literal (strings,
numbers, True / False / None, lists, dicts) and becomes JSON; a string argument streams as it is written.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers.base import Block, CallText, Schemas, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALLS_FIRST = re.compile(r"\s*(?:<\|python_start\|>\s*(?:\[|\Z)|\[)")
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*(\(?)")
_KEY = re.compile(r"\s*([A-Za-z_]\w*)\s*(=?)")
_SPACE = re.compile(r"\s*")
# a Python literal's outline: strings (either quote, escapes), brackets, anything else up to a delimiter
_TOKEN = re.compile(r"""'(?:[^'\\\n]++|\\.)*+'|"(?:[^"\\\n]++|\\.)*+"|[\[\]{}()]|,|[^'"\[\]{}(),]+|['"]""", re.DOTALL)
_OPEN_STRING = re.compile(r"""(['"])((?:(?!\1)[^\\\n]|\\.)*\\?)(\1\s*)?\Z""", re.DOTALL)


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = (PYTHON_START, PYTHON_END)

    def find_block(self, text: str, pos: int) -> int:
        return 0 if pos == 0 and _CALLS_FIRST.match(text) else -1

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        if "[" not in text:
            return Block("pending")         # <|python_start|> so far
        pos = text.index("[", start) + 1
        calls: list[CallText] = []
        while True:
            name = _NAME.match(text, pos)
            if (name.end() if name else _SPACE.match(text, pos).end()) == len(text) and not final:  # type: ignore
                return Block("calls", None, calls) if calls else Block("pending")
            if name is None or not name.group(2) or name.group(1) not in tools:
                return Block("calls", pos, calls) if calls else Block("content", _list_end(text, start))
            call, pos = _read_call(text, name.group(1), name.end(), final)
            calls.append(call)
            if not call.done:
                return Block("calls", pos if final else None, calls)
            pos = _SPACE.match(text, pos).end()                             # type: ignore[union-attr]
            if text.startswith(",", pos):
                pos += 1
                continue
            if text.startswith("]", pos):
                after = _SPACE.match(text, pos + 1).end()                   # type: ignore[union-attr]
                if text.startswith(PYTHON_END, after):
                    return Block("calls", after + len(PYTHON_END), calls)
                if PYTHON_END.startswith(text[after:]) and after < len(text) and not final:
                    return Block("calls", None, calls)
                return Block("calls", pos + 1, calls)
            if pos >= len(text) and not final:
                return Block("calls", None, calls)
            return Block("calls", pos, calls)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You are an expert in composing functions. You may call one or more functions to answer the user. "
                f"The functions you can call, in JSON:\n{listing}\n\nTo call functions, answer with only a Python "
                "list of calls with keyword arguments: [func_name1(param1=value1, param2=value2), func_name2()]")

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "[" + ", ".join(f"{c['name']}(" + ", ".join(f"{k}={_literal(v)}" for k, v in c["arguments"].items())
                               + ")" for c in calls) + "]"


def _literal(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _read_call(text: str, name: str, pos: int, final: bool) -> tuple[CallText, int]:
    """`key=value, ...)` from `pos` -> (the call so far, where reading stopped)."""
    parts: list[str] = []
    while True:
        pos = _SPACE.match(text, pos).end()                                 # type: ignore[union-attr]
        if text.startswith(")", pos):
            return CallText(name, "{" + ", ".join(parts) + "}", True), pos + 1
        key = _KEY.match(text, pos)
        if key is None or not key.group(2):
            return CallText(name, "{" + ", ".join(parts), False), pos
        end, value = _value(text, key.end())
        if end is None:
            partial = _partial_string(text[_SPACE.match(text, key.end()).end():])  # type: ignore[union-attr]
            if partial is not None:
                parts.append(f"{json.dumps(key.group(1))}: {json.dumps(partial, ensure_ascii=False)[:-1]}")
            return CallText(name, "{" + ", ".join(parts), False), len(text) if partial is not None else pos
        if value is _BAD:
            return CallText(name, "{" + ", ".join(parts), False), pos
        parts.append(f"{json.dumps(key.group(1))}: {json.dumps(value, ensure_ascii=False)}")
        pos = _SPACE.match(text, end).end()                                 # type: ignore[union-attr]
        if text.startswith(",", pos):
            pos += 1


_BAD = object()


def _value(text: str, pos: int) -> tuple[int | None, Any]:
    """The literal at `pos`: (its end, its value), (None, None) while it may still grow, or (end, _BAD)."""
    depth, start = 0, pos
    for match in _TOKEN.finditer(text, pos):
        token = match.group()
        if token in "([{" and token:
            depth += 1
        elif token in ")]}" and token:
            if depth == 0:
                return _evaluated(text[start:match.start()], match.start())
            depth -= 1
        elif token == "," and depth == 0:
            return _evaluated(text[start:match.start()], match.start())
        elif token[0] in "'\"" and (len(token) < 2 or token[-1] != token[0]):
            return None, None
    return None, None


def _evaluated(source: str, end: int) -> tuple[int, Any]:
    try:
        return end, ast.literal_eval(source.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return end, _BAD


def _partial_string(source: str) -> str | None:
    """A string literal still being written, as far as it reads (an escape cut in two waits); None if `source` is
    not such a string."""
    match = _OPEN_STRING.match(source)
    if match is None:
        return None
    quote, body = match.group(1), match.group(2)
    if match.group(3):                              # closed: whole, though what ends the argument is still to come
        try:
            return ast.literal_eval(quote + body + quote)
        except (ValueError, SyntaxError):
            return None
    for cut in range(min(len(body), 10) + 1):       # the longest escape is \N{...} or \U0001F600: back off a little
        try:
            return ast.literal_eval(quote + body[:len(body) - cut] + quote)
        except (ValueError, SyntaxError):
            continue
    return None


def _list_end(text: str, start: int) -> int | None:
    """Where the bracketed list at `start` ends, or None while it is open."""
    depth = 0
    for match in _TOKEN.finditer(text, text.index("[", start)):
        token = match.group()
        if token == "[":
            depth += 1
        elif token == "]":
            depth -= 1
            if depth == 0:
                return match.end()
    return None
