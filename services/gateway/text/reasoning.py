"""Reasoning models' thinking, split from the answer (`--reasoning-parser`, under vLLM's names): the thinking becomes
reasoning (chat completions' `reasoning_content`, Messages' `thinking` blocks, Responses' `reasoning` items); the rest
is the content that tool-call parsing and the client see.

    deepseek_r1     DeepSeek-R1 and templates that open `<think>` in the prompt: everything before `</think>` is
                    reasoning (a leading `<think>` is dropped); a reply without `</think>` is all reasoning (it was
                    cut while thinking).
    qwen3, glm45, kimi_k2, deepseek_v3
                    reasoning only when the reply opens with `<think>`; then up to `</think>` (or the end).
    granite         Granite 3.2+: "Here is my thought process:" (or "Here's ...") opens it, "Here is my response:"
                    (or "Here's ...") ends it.
    mistral         Magistral: `[THINK]` … `[/THINK]` (special tokens, kept when detokenizing).
    openai_gptoss   gpt-oss: the harmony format's analysis channel (reasoning_harmony.py).

The split runs on each choice's TextEvents as they stream, holding back text that may be the start of a marker,
as stop strings do, so it is the same however the text was cut. max_tokens counts reasoning and content tokens
alike (one generation), as vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from steploop.gateway.text.reasoning_harmony import HarmonySplitter
from steploop.gateway.text.stop_strings import held_suffix_len

if TYPE_CHECKING:   # config.py imports this module; it stays free of the engine's types at run time
    from steploop.gateway.text.generation import TextEvent

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
GRANITE_OPEN = ("Here is my thought process:", "Here's my thought process:")
GRANITE_CLOSE = ("Here is my response:", "Here's my response:")


class Splitter(Protocol):
    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        """A delta of one choice's text -> (reasoning, content) that is safe to send now."""


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool = False      # deepseek_r1: the reply is reasoning until a close marker
    opens: tuple[str, ...] = (THINK_OPEN,)
    closes: tuple[str, ...] = (THINK_CLOSE,)
    harmony: bool = False                  # gpt-oss: channels, not markers
    needs_special_tokens: bool = False     # its markers are special tokens: keep them when detokenizing

    def splitter(self) -> Splitter:
        return HarmonySplitter() if self.harmony else ReasoningSplitter(self)


REASONING_PARSERS = {p.name: p for p in (
    ReasoningParser("deepseek_r1", starts_in_reasoning=True),
    ReasoningParser("qwen3"),
    ReasoningParser("deepseek_v3"),
    ReasoningParser("glm45"),
    ReasoningParser("kimi_k2"),
    ReasoningParser("granite", opens=GRANITE_OPEN, closes=GRANITE_CLOSE),
    ReasoningParser("mistral", opens=("[THINK]",), closes=("[/THINK]",), needs_special_tokens=True),
    ReasoningParser("openai_gptoss", harmony=True, needs_special_tokens=True),
)}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if not name:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}") from None


class ReasoningSplitter:
    """One choice's stream for the marker formats: feed(delta) -> (reasoning, content) that is safe to send now."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.state = "start"   # start: nothing decided; think: inside; after: just closed; answer: the rest
        self.parser = parser
        self.pending = ""

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        text, reasoning = self.pending + delta, ""
        self.pending = ""
        if self.state == "start":
            stripped = text.lstrip()
            opened = next((m for m in self.parser.opens if stripped.startswith(m)), None)
            if opened is not None:
                self.state, text = "think", stripped[len(opened):]
            elif any(m.startswith(stripped) for m in self.parser.opens) and not last:
                self.pending = text            # may still become the open marker
                return "", ""
            else:
                self.state = "think" if self.parser.starts_in_reasoning else "answer"
        if self.state == "think":
            end, close = min(((text.find(m), m) for m in self.parser.closes if m in text), default=(-1, ""))
            if end >= 0:
                reasoning, text, self.state = text[:end], text[end + len(close):], "after"
            else:
                hold = 0 if last else held_suffix_len(text, self.parser.closes)
                self.pending = text[len(text) - hold:] if hold else ""
                return text[:len(text) - hold], ""
        if self.state == "after":   # the blank lines between the close marker and the answer belong to neither
            text = text.lstrip("\n")
            if text:
                self.state = "answer"
        return reasoning, text


async def split_reasoning(events: AsyncIterator[TextEvent], parser: ReasoningParser | None
                          ) -> AsyncIterator[TextEvent]:
    """The events with thinking moved into `TextEvent.reasoning`; unchanged without a parser."""
    if parser is None:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
        return
    splitters: dict[int, Splitter] = {}
    async with contextlib.aclosing(events):
        async for event in events:
            splitter = splitters.setdefault(event.index, parser.splitter())
            reasoning, content = splitter.feed(event.text, last=event.finish_reason is not None)
            if reasoning or content or event.finish_reason is not None or event.logprobs:
                yield replace(event, text=content, reasoning=reasoning)
