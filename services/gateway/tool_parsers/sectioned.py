"""Formats that wrap their calls in a section of special tokens, each call in its own begin/end pair (DeepSeek V3,
Kimi K2): the section markers are framing; each call is read by the subclass's `read_call`."""

from __future__ import annotations

import re
from typing import ClassVar

from steploop.gateway.tool_parsers import json_text
from steploop.gateway.tool_parsers.base import Block, CallText, Schemas, ToolParser, held_prefix


class SectionedParser(ToolParser):
    section_begin: ClassVar[str]
    section_end: ClassVar[str]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    needs_special_tokens = True
    _find: ClassVar[re.Pattern[str]]

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls.markers = (cls.section_begin, cls.call_begin, cls.section_end, cls.call_end)
        cls._find = re.compile("|".join(re.escape(m) for m in (cls.section_begin, cls.call_begin, cls.section_end)))

    def find_block(self, text: str, pos: int) -> int:
        match = self._find.search(text, pos)
        return match.start() if match else -1

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        for marker in (self.section_begin, self.section_end):
            if text.startswith(marker, start):
                return Block("skip", start + len(marker))
        return self.read_call(text, start + len(self.call_begin), final, tools)

    def call_id(self, text: str, pos: int) -> str:
        """The call's id as the format writes it at `pos`, or "" (the gateway makes one)."""
        return ""

    def read_call(self, text: str, pos: int, final: bool, tools: Schemas) -> Block:
        """One call from `pos` (after call_begin): the subclass finds its name and where its JSON arguments begin."""
        header = self.read_header(text, pos)
        if header is None:
            end = text.find(self.call_end, pos)
            return Block("content", end + len(self.call_end) if end >= 0 else None)
        if header == "pending":
            return Block("pending")
        name, args_at = header
        if name not in tools:
            end = text.find(self.call_end, pos)
            return Block("content", end + len(self.call_end) if end >= 0 else None)
        args_end, call_id = json_text.value_end(text, args_at), self.call_id(text, pos)
        if args_end is None:
            return Block("calls", None, [CallText(name, text[args_at:], False, call_id)])
        call = CallText(name, text[args_at:args_end], True, call_id)
        after = self.skip_trailer(text, args_end)
        if text.startswith(self.call_end, after):
            return Block("calls", after + len(self.call_end), [call])
        if held_prefix(text, after, self.call_end) and not final:
            return Block("calls", None, [call])
        return Block("calls", args_end, [call])

    def read_header(self, text: str, pos: int) -> tuple[str, int] | str | None:
        """(name, where the arguments begin), "pending", or None if this is not a call."""
        raise NotImplementedError

    def skip_trailer(self, text: str, pos: int) -> int:
        """Past what the format writes between the arguments and call_end."""
        return json_text.skip_space(text, pos)
