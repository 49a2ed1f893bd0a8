"""Turns the merged `TextEvent`s of a request into what the client gets: streamed chunks or one whole body."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gateway import responses
from services.gateway.generation import TextEvent, Usage, total_usage
from services.gateway.logprobs import TokenInfo, chat_logprobs, completion_logprobs
from services.gateway.responses import Meta


@dataclass
class Collected:
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    usages: dict[int, Usage] = field(default_factory=dict)
    logprobs: dict[int, list[TokenInfo]] = field(default_factory=dict)   # only choices that asked


async def collect(events: AsyncIterator[TextEvent]) -> Collected:
    out = Collected()
    async with contextlib.aclosing(events):
        async for event in events:
            out.texts[event.index] = out.texts.get(event.index, "") + event.text
            if event.logprobs is not None:
                out.logprobs.setdefault(event.index, []).extend(event.logprobs)
            if event.finish_reason is not None:
                out.finish[event.index] = event.finish_reason
                out.usages[event.index] = event.usage or Usage()
    return out


async def completion_body(meta: Meta, events: AsyncIterator[TextEvent], n: int, logprobs: bool) -> dict[str, Any]:
    got = await collect(events)
    lps = {i: completion_logprobs(got.logprobs.get(i, ())) for i in got.texts} if logprobs else {}
    return responses.completion(meta, got.texts, got.finish, total_usage(got.usages, n), lps)


async def chat_body(meta: Meta, events: AsyncIterator[TextEvent], n: int, logprobs: bool) -> dict[str, Any]:
    got = await collect(events)
    lps = {i: chat_logprobs(got.logprobs.get(i, ())) for i in got.texts} if logprobs else {}
    return responses.chat_completion(meta, got.texts, got.finish, total_usage(got.usages, n), lps)


async def completion_chunks(meta: Meta, events: AsyncIterator[TextEvent], n: int, include_usage: bool,
                            logprobs: bool = False) -> AsyncIterator[dict[str, Any]]:
    usages: dict[int, Usage] = {}
    offsets: dict[int, int] = {}     # text_offset of each choice's next token
    async with contextlib.aclosing(events):
        async for event in events:
            if event.usage is not None:
                usages[event.index] = event.usage
            if event.text or event.finish_reason:
                lps = None
                if logprobs:
                    lps = completion_logprobs(event.logprobs or (), offsets.get(event.index, 0))
                    offsets[event.index] = offsets.get(event.index, 0) + sum(len(t.token) for t in event.logprobs or ())
                yield responses.completion_chunk(meta, event.index, event.text, event.finish_reason, lps)
    if include_usage:
        yield responses.usage_chunk(meta, "text_completion", total_usage(usages, n))


async def chat_chunks(meta: Meta, events: AsyncIterator[TextEvent], indices: Sequence[int], n: int,
                      include_usage: bool, logprobs: bool = False) -> AsyncIterator[dict[str, Any]]:
    """Per choice: a first delta with the role, then content deltas, then one with finish_reason.
    The role deltas wait for the first event, so an engine that fails at once still gets a real HTTP status."""
    usages: dict[int, Usage] = {}
    started = False
    async with contextlib.aclosing(events):
        async for event in events:
            if not started:
                started = True
                for index in indices:
                    yield responses.chat_chunk(meta, index, {"role": "assistant", "content": ""}, None)
            if event.usage is not None:
                usages[event.index] = event.usage
            if event.text or event.finish_reason:
                delta = {"content": event.text} if event.text else {}
                lps = chat_logprobs(event.logprobs or ()) if logprobs else None
                yield responses.chat_chunk(meta, event.index, delta, event.finish_reason, lps)
    if include_usage:
        yield responses.usage_chunk(meta, "chat.completion.chunk", total_usage(usages, n))
