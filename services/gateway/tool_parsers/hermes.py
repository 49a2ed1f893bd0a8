"""Hermes: what Qwen, Hermes and most open tool-tuned models write (vLLM's `--tool-call-parser hermes`).

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first tag is the content; the last call may lack its closing tag when the reply ends there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers.base import ToolParser, listing, loads

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"
    start = CALL_OPEN

    def call_values(self, calls_text: str) -> list[Any] | None:
        # One unreadable call (None here) makes the whole reply text, as vLLM does.
        return [loads(match.group(1)) for match in _CALL_RE.finditer(calls_text)]

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions you can call are "
                f"described in JSON inside <tools></tools>:\n<tools>\n{listing(tools)}\n</tools>\n\nTo call a "
                "function, answer with one JSON object per call, each inside <tool_call></tool_call> tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "\n".join(f"{CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CALL_CLOSE}" for call in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
