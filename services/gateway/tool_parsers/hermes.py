"""Hermes: what Qwen, Hermes and most open tool-tuned models write (vLLM's `--tool-call-parser hermes`).

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first tag is the content; the last call may lack its closing tag when the reply ends there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers import json_text
from steploop.gateway.tool_parsers.base import Block, Schemas, ToolParser, held_prefix, listing, read_json_call

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (CALL_OPEN, CALL_CLOSE)

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        return read_tagged_json(text, start + len(CALL_OPEN), CALL_CLOSE, final, tools)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions you can call are "
                f"described in JSON inside <tools></tools>:\n<tools>\n{listing(tools)}\n</tools>\n\nTo call a "
                "function, answer with one JSON object per call, each inside <tool_call></tool_call> tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "\n".join(f"{CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CALL_CLOSE}" for call in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def read_tagged_json(text: str, pos: int, close: str, final: bool, tools: Schemas) -> Block:
    """A {"name", "arguments"} object at `pos`, then `close` (which a reply may end without)."""
    state, call, end = read_json_call(text, pos, tools)
    if state == "content":
        found = text.find(close, pos)
        return Block("content", found + len(close) if found >= 0 else None)
    if state == "pending" or call is None:
        return Block("pending")
    if end is None:
        return Block("calls", None, [call])
    after = json_text.skip_space(text, end)
    if text.startswith(close, after):
        return Block("calls", after + len(close), [call])
    if held_prefix(text, after, close) and not final:
        return Block("calls", None, [call])     # the close tag is arriving: nothing after the call is known yet
    return Block("calls", end, [call])
