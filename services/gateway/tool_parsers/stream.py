"""A reply under tool_choice "auto", read as it grows: `CallSplitter` rescans the reply after each delta (the
format's `scan`) and returns what is new since the last scan as OpenAI's streaming deltas: content text, a call's
first delta (index, id, type, name, empty arguments), then its arguments in pieces as they are written. Reading a
whole reply is the same splitter fed once, so streamed and whole replies cannot differ.

Each rescan reads the reply from its start, so while a call is being written (the long case: a file's content as
an argument) a rescan waits until the reply has grown by 1/RESCAN_GROWTH since the last one: the cost of a call
stays linear in its length, and its arguments still arrive every delta while short (below RESCAN_GROWTH * 4
characters) and in pieces of a few tokens beyond. Skipping a scan changes no output, only when it is sent: a scan
reports only what can no longer change. Content outside calls is scanned every delta."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from steploop.gateway.tool_parsers.base import CallText, Schemas, ToolCall, ToolParser
from steploop.gateway.tool_parsers.json_text import JsonNormalizer

RESCAN_GROWTH = 64
Delta = dict[str, Any]    # {"content": str} or {"tool_calls": [...]}, as in a chat.completion.chunk's delta


class CallSplitter:
    def __init__(self, parser: ToolParser, tools: Schemas, new_id: Callable[[], str], max_calls: int | None = None
                 ) -> None:
        self.parser, self.tools, self.new_id, self.max_calls = parser, tools, new_id, max_calls
        self.text = ""                       # the whole reply so far
        self.content: list[str] = []         # content sent, per content segment
        self.calls: list[ToolCall] = []      # calls begun (arguments: as sent so far)
        self._args: list[JsonNormalizer] = []
        self._done: list[bool] = []
        self._scanned = 0                    # len(text) at the last scan
        self._in_call = False                # the last scan ended inside a call's arguments

    def feed(self, delta: str) -> list[Delta]:
        """Adds a delta of the reply; returns the deltas it makes sendable."""
        self.text += delta
        if not delta or (self._in_call and len(self.text) - self._scanned < len(self.text) // RESCAN_GROWTH):
            return []
        self._scanned = len(self.text)
        segments = self.parser.scan(self.text, False, self.tools)
        last_call = segments[-2] if len(segments) > 1 else None
        self._in_call = isinstance(last_call, CallText) and not last_call.done and segments[-1] == ""
        return self._advance(segments, final=False)

    def finish(self) -> list[Delta]:
        """The reply has ended: everything it still holds."""
        return self._advance(self.parser.scan(self.text, True, self.tools), final=True)

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) as sent in all."""
        return "".join(self.content) or None, list(self.calls)

    def _advance(self, segments: list[CallText | str], final: bool) -> list[Delta]:
        out: list[Delta] = []
        for i, segment in enumerate(segments):
            if isinstance(segment, str):
                out += self._content(i // 2, segment)
            elif self.max_calls is None or i // 2 < self.max_calls:
                out += self._call(i // 2, segment, final)
        return out

    def _content(self, j: int, text: str) -> list[Delta]:
        if j == len(self.content):
            self.content.append("")
        sent = self.content[j]
        if not text.startswith(sent):
            raise AssertionError(f"{self.parser.name}: content {sent!r} was sent, the reply now reads {text!r}")
        self.content[j] = text
        return [{"content": text[len(sent):]}] if len(text) > len(sent) else []

    def _call(self, j: int, call: CallText, final: bool) -> list[Delta]:
        out: list[Delta] = []
        if j == len(self.calls):
            self.calls.append(ToolCall(call.id or self.new_id(), call.name, ""))
            self._args.append(JsonNormalizer())
            self._done.append(False)
            out.append({"tool_calls": [{"index": j, **self.calls[j].to_dict()}]})
        if self._done[j]:
            return out
        norm = self._args[j]
        if call.name != self.calls[j].name or not call.arguments.startswith(norm.raw):
            raise AssertionError(f"{self.parser.name}: call {j} was read as {self.calls[j].name}({norm.raw!r}), the "
                                 f"reply now reads {call.name}({call.arguments!r})")
        piece = norm.feed_to(call.arguments)
        if call.done or final:
            piece += norm.finish()
            self._done[j] = True
        if piece:
            old = self.calls[j]
            self.calls[j] = ToolCall(old.id, old.name, old.arguments + piece)
            out.append({"tool_calls": [{"index": j, "function": {"arguments": piece}}]})
        return out


def split_whole(parser: ToolParser, text: str, tools: Schemas, new_id: Callable[[], str],
                max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (content or None, calls)."""
    splitter = CallSplitter(parser, tools, new_id, max_calls)
    splitter.text = text
    splitter.finish()
    return splitter.result()
