"""Kimi K2's calls (vLLM's `--tool-call-parser kimi_k2`), in special tokens, each named `functions.NAME:INDEX`:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

As vLLM's parser, a call's id is the one the model wrote (`functions.get_weather:0`): Kimi's templates write earlier
calls and their results back under that id.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from steploop.gateway.text.stop_strings import held_suffix_len
from steploop.gateway.tool_parsers.base import listing
from steploop.gateway.tool_parsers.sectioned import SectionedParser

ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_LONGEST_HEADER = 256     # a header not complete within this many characters is not one


class KimiK2Parser(SectionedParser):
    name = "kimi_k2"
    section_begin, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin, call_end = "<|tool_call_begin|>", "<|tool_call_end|>"

    def read_header(self, text: str, pos: int) -> tuple[str, int] | str | None:
        at = text.find(ARGUMENT_BEGIN, pos)
        if at < 0:
            rest = text[pos:]
            rest = rest[:len(rest) - held_suffix_len(rest, (ARGUMENT_BEGIN,))]
            return "pending" if "<" not in rest and len(rest) < _LONGEST_HEADER else None
        call_id = text[pos:at].strip()              # functions.get_weather:0
        name = call_id.rpartition(":")[0] if ":" in call_id else call_id
        return name.partition(".")[2] if "." in name else name, at + len(ARGUMENT_BEGIN)

    def call_id(self, text: str, pos: int) -> str:
        return text[pos:text.find(ARGUMENT_BEGIN, pos)].strip()

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call functions. The functions you can call, in JSON:\n"
                f"{listing(tools)}\n\nTo call functions, answer with:\n{self.section_begin}{self.call_begin}"
                f"functions.<function-name>:<index>{ARGUMENT_BEGIN}<arguments-object>{self.call_end}"
                f"{self.section_end}")

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return self.section_begin + "".join(
            f"{self.call_begin}functions.{c['name']}:{i}{ARGUMENT_BEGIN}"
            f"{json.dumps(c['arguments'], ensure_ascii=False)}{self.call_end}" for i, c in enumerate(calls)
        ) + self.section_end

    def render_result(self, content: str) -> str:
        return f"## Return of the function call\n{content}"
