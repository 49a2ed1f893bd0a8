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

from steploop.gateway.tool_parsers.base import ToolParser, listing

TOOL_CALLS = "[TOOL_CALLS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_NAMED_CALL_RE = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})(?:\[ARGS\])?(\{.*\})\s*$", re.DOTALL)
_ID_LENGTH = 9


class MistralParser(ToolParser):
    name = "mistral"
    start = TOOL_CALLS
    needs_special_tokens = True

    def call_values(self, calls_text: str) -> list[Any] | None:
        return _call_values(calls_text.split(TOOL_CALLS)[1:])

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


def _call_values(parts: list[str]) -> list[Any] | None:
    """The text after each marker as call objects: a JSON array (or one object) of {"name", "arguments"}, or
    `name{arguments}`; None if any part is neither."""
    values: list[Any] = []
    for part in parts:
        try:
            value = json.loads(part)
        except ValueError:
            named = _NAMED_CALL_RE.match(part)
            if named is None:
                return None
            try:
                value = {"name": named.group(1), "arguments": json.loads(named.group(2))}
            except ValueError:
                return None
        values.extend(value if isinstance(value, list) else [value])
    return values
