"""Mistral: `[TOOL_CALLS]` then the calls (vLLM's `--tool-call-parser mistral`). Two spellings, by tokenizer version:

    The weather, then.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (v3, Mistral 7B v0.3)
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}                              (v11+, Small 3.1+)

Text before the marker is the content. `[TOOL_CALLS]` is a special token in Mistral's vocabularies, so requests
that may call keep special tokens when detokenizing. Mistral's templates accept only 9-character alphanumeric call
ids (mistral-common's rule): calls get such ids, and a client's other ids are shortened to one when rendered.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers import json_text
from steploop.gateway.tool_parsers.base import Block, CallText, Schemas, ToolParser, listing
from steploop.gateway.tool_parsers.json_calls import read_call_list

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ID_LENGTH = 9


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    needs_special_tokens = True

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        pos = json_text.skip_space(text, start + len(TOOL_CALLS))
        if pos >= len(text):
            return Block("pending")
        if text[pos] in "[{":
            return read_call_list(text, pos, final, tools, open_="[" if text[pos] == "[" else "")
        return _read_named(text, pos, tools)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions you can call, in "
                f"JSON:\n{listing(tools)}\n\nTo call functions, answer with {TOOL_CALLS} followed by a JSON array "
                f'of the calls:\n{TOOL_CALLS}[{{"name": <function-name>, "arguments": <arguments-object>}}]')

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return TOOL_CALLS + json.dumps(list(calls), ensure_ascii=False)

    def render_result(self, content: str) -> str:
        return f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"

    def new_call_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=_ID_LENGTH))

    def template_call_id(self, call_id: str) -> str:
        """The last 9 alphanumerics of the id (as vLLM truncates them), zero-padded: the same id always maps to
        the same one, so a call and its tool result still match."""
        kept = "".join(ch for ch in call_id if ch in _ALPHANUMERIC)[-_ID_LENGTH:]
        return kept.rjust(_ID_LENGTH, "0")


def _read_named(text: str, pos: int, tools: Schemas) -> Block:
    """v11+: `name{arguments}` or `name[ARGS]{arguments}`."""
    match = _NAME_RE.match(text, pos)
    if match is None:
        return Block("content", pos)
    args = match.end()
    if text.startswith(ARGS, args):
        args += len(ARGS)
    elif ARGS.startswith(text[args:]) and args < len(text) or args == len(text):
        return Block("pending")                  # the name, or [ARGS], may still be growing
    args = json_text.skip_space(text, args)
    if args >= len(text):
        return Block("pending")
    if text[args] != "{" or match.group() not in tools:
        return Block("content", args)
    end = json_text.value_end(text, args)
    call = CallText(match.group(), text[args:end if end is not None else len(text)], end is not None)
    return Block("calls", end, [call])
