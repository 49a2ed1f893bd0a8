"""Readers for the JSON shapes several formats share: a JSON array of {"name", "arguments"} objects (Mistral v3,
Granite), and objects separated by a character (Llama 3's ";")."""

from __future__ import annotations

from steploop.gateway.tool_parsers import json_text
from steploop.gateway.tool_parsers.base import Block, CallText, Schemas, read_json_call


def read_call_list(text: str, pos: int, final: bool, tools: Schemas, open_: str = "[", sep: str = ",",
                   close: str | None = "]") -> Block:
    """Call objects from `pos`: `open_` (may be ""), objects separated by `sep`, then `close` (None: the list ends
    where something else follows). A list whose first item is not a call is content; after calls, whatever does
    not continue the list is content."""
    i = json_text.skip_space(text, pos)
    if open_:
        if i >= len(text):
            return Block("pending")
        if not text.startswith(open_, i):
            return Block("content", i)
        i += len(open_)
    calls: list[CallText] = []
    while True:
        i = json_text.skip_space(text, i)
        if i >= len(text):
            return _open_list(calls, i, final)
        if close is not None and text.startswith(close, i) and not calls:
            return Block("content", i + len(close))
        state, call, end = read_json_call(text, i, tools)
        if state == "pending":
            return _open_list(calls, i, final)
        if state == "content" or call is None:
            if calls:
                return Block("calls", i, calls)
            stop = json_text.value_end(text, pos)
            return Block("content", stop)
        calls.append(call)
        if end is None:
            return Block("calls", None, calls)
        j = json_text.skip_space(text, end)
        if j >= len(text):
            return _open_list(calls, end, final)
        if text.startswith(sep, j):
            i = j + len(sep)
        elif close is not None and text.startswith(close, j):
            return Block("calls", j + len(close), calls)
        else:
            return Block("calls", end, calls)


def _open_list(calls: list[CallText], resume: int, final: bool) -> Block:
    """The text ends inside the list: wait (or, at the end of the reply, what follows the calls is content)."""
    if not calls:
        return Block("pending")
    return Block("calls", resume if final else None, calls)
