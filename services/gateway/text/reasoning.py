"""Reasoning models' thinking, split from the answer (`--reasoning-parser`, as vLLM's): the text a model writes
inside `<think>…</think>` becomes reasoning (chat completions' `reasoning_content`, Messages' `thinking` blocks,
Responses' `reasoning` items); the rest is the content that tool-call parsing and the client see.

    deepseek_r1   DeepSeek-R1 and templates that open `<think>` in the prompt: everything before `</think>` is
                  reasoning (a leading `<think>` is dropped); a reply without `</think>` is all reasoning (it
                  was cut while thinking).
    qwen3         Qwen3: reasoning only when the reply opens with `<think>`; then up to `</think>` (or the end).

The split runs on each choice's TextEvents as they stream, holding back text that may be the start of a marker,
as stop strings do. max_tokens counts reasoning and content tokens alike (one generation), as vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from steploop.gateway.text.stop_strings import held_suffix_len

if TYPE_CHECKING:   # config.py imports this module; it stays free of the engine's types at run time
    from steploop.gateway.text.generation import TextEvent

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool   # deepseek_r1: the reply is reasoning until </think> (the prompt opened it)


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False))}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if not name:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}") from None


class ReasoningSplitter:
    """One choice's stream: feed(delta) -> (reasoning, content) that is safe to send now."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.state = "start"   # start: nothing decided; think: inside; after: just closed; answer: the rest
        self.parser = parser
        self.pending = ""

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        text, reasoning = self.pending + delta, ""
        self.pending = ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.state, text = "think", stripped[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(stripped) and not last:
                self.pending = text            # may still become "<think>"
                return "", ""
            else:
                self.state = "think" if self.parser.starts_in_reasoning else "answer"
        if self.state == "think":
            end = text.find(THINK_CLOSE)
            if end >= 0:
                reasoning, text, self.state = text[:end], text[end + len(THINK_CLOSE):], "after"
            else:
                hold = 0 if last else held_suffix_len(text, (THINK_CLOSE,))
                self.pending = text[len(text) - hold:] if hold else ""
                return text[:len(text) - hold], ""
        if self.state == "after":   # the blank lines between </think> and the answer belong to neither
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
    splitters: dict[int, ReasoningSplitter] = {}
    async with contextlib.aclosing(events):
        async for event in events:
            splitter = splitters.setdefault(event.index, ReasoningSplitter(parser))
            reasoning, content = splitter.feed(event.text, last=event.finish_reason is not None)
            if reasoning or content or event.finish_reason is not None or event.logprobs:
                yield replace(event, text=content, reasoning=reasoning)
