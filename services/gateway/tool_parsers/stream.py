"""Streaming under tool_choice "auto": text is content until the format's start marker begins; from there it is
held back (the calls are parsed from the whole reply at its end). A suffix that may be the start of the marker
waits for the next delta, as stop strings do."""

from __future__ import annotations

from steploop.gateway.tool_parsers.base import ToolParser


class ContentSplitter:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""          # the whole reply so far
        self._emitted = 0
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """Adds a delta; returns the content that is safe to send now."""
        self.text += delta
        if self.in_calls:
            return ""
        start = self.parser.find_start(self.text, self._emitted)
        if start >= 0:
            self.in_calls = True
            end = start
        else:
            end = len(self.text) - self.parser.held_len(self.text)
        out, self._emitted = self.text[self._emitted:end], max(end, self._emitted)
        return out

    def held(self) -> str:
        """What was not emitted: the calls, or the end of a reply that stopped on a marker's first characters."""
        return self.text[self._emitted:]
