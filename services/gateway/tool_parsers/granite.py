"""IBM Granite 3.x's calls (vLLM's `--tool-call-parser granite`): the reply is a JSON array of calls, after
`<|tool_call|>` (Granite 3.0's special token) or `<tool_call>` (3.1+), or on its own:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

As vLLM's parser, calls are read only at the start of the reply; text that follows the array is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers import json_text
from steploop.gateway.tool_parsers.base import Block, Schemas, ToolParser, listing
from steploop.gateway.tool_parsers.json_calls import read_call_list

TOKEN, TAG = "<|tool_call|>", "<tool_call>"
_CALLS_FIRST = re.compile(r"\s*(?:<\|tool_call\|>|<tool_call>|\[)")


class GraniteParser(ToolParser):
    name = "granite"
    markers = (TOKEN, TAG)

    def find_block(self, text: str, pos: int) -> int:
        return 0 if pos == 0 and _CALLS_FIRST.match(text) else -1

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        pos = json_text.skip_space(text, start)
        for marker in (TOKEN, TAG):
            if text.startswith(marker, pos):
                pos += len(marker)
        return read_call_list(text, pos, final, tools)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("You are a helpful assistant with access to the following function calls. Your task is to produce "
                f"a list of function calls necessary to generate response to the user utterance.\n{listing(tools)}\n"
                f'To call functions, answer with {TOKEN} and a JSON array: {TOKEN}[{{"name": <function-name>, '
                '"arguments": <arguments-object>}]')

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return TOKEN + json.dumps(list(calls), ensure_ascii=False)
