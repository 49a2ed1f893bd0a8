"""DeepSeek V3 / R1-0528's calls (vLLM's `--tool-call-parser deepseek_v3`), in special tokens, arguments in a fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.tool_parsers import json_text
from steploop.gateway.tool_parsers.base import held_prefix, listing
from steploop.gateway.tool_parsers.sectioned import SectionedParser

SEP = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
_HEADER = re.compile(r"([^<\n]*)<｜tool▁sep｜>([^\n]*)\n\s*```json")
_LONGEST_HEADER = 256     # a header not complete within this many characters is not one


class DeepSeekV3Parser(SectionedParser):
    name = "deepseek_v3"
    section_begin, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"

    def read_header(self, text: str, pos: int) -> tuple[str, int] | str | None:
        match = _HEADER.match(text, pos)
        if match:
            return match.group(2).strip(), match.end()    # the arguments' JSON follows, after space
        rest = text[pos:]
        return "pending" if self.call_end not in rest and len(rest) < _LONGEST_HEADER else None

    def skip_trailer(self, text: str, pos: int) -> int:
        pos = json_text.skip_space(text, pos)
        if text.startswith(FENCE_CLOSE, pos):
            pos += len(FENCE_CLOSE)
        elif held_prefix(text, pos, FENCE_CLOSE):
            return len(text)            # the fence is arriving: so may the call's end
        return json_text.skip_space(text, pos)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("## Tools\n\n### Function\n\nYou have the following functions available:\n\n"
                f"{listing(tools)}\n\nTo call functions, answer with:\n{self.section_begin}{self.call_begin}function"
                f"{SEP}<function-name>\n```json\n<arguments-object>\n```{self.call_end}{self.section_end}")

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return self.section_begin + "".join(
            f"{self.call_begin}function{SEP}{c['name']}\n```json\n{json.dumps(c['arguments'], ensure_ascii=False)}"
            f"\n```{self.call_end}" for c in calls) + self.section_end

    def render_result(self, content: str) -> str:
        return f"<｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>"
