"""Turns the merged `TextEvent`s of a request into what the client gets: streamed chunks or one whole body."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from services.gateway import responses
from services.gateway.generation import TextEvent, Usage, total_usage
from services.gateway.responses import Meta


async def collect(events: AsyncIterator[TextEvent]) -> tuple[dict[int, str], dict[int, str | None],
                                                              dict[int, Usage]]:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    usages: dict[int, Usage] = {}
    async with contextlib.aclosing(events):
        async for event in events:
            texts.setdefault(event.index, []).append(event.text)
            if event.finish_reason is not None:
                finish[event.index] = event.finish_reason
                usages[event.index] = event.usage or Usage()
    return {i: "".join(parts) for i, parts in texts.items()}, finish, usages


async def completion_body(meta: Meta, events: AsyncIterator[TextEvent], n: int) -> dict[str, Any]:
    texts, finish, usages = await collect(events)
    return responses.completion(meta, texts, finish, total_usage(usages, n))


async def chat_body(meta: Meta, events: AsyncIterator[TextEvent], n: int) -> dict[str, Any]:
    texts, finish, usages = await collect(events)
    return responses.chat_completion(meta, texts, finish, total_usage(usages, n))


async def completion_chunks(meta: Meta, events: AsyncIterator[TextEvent], n: int,
                            include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    usages: dict[int, Usage] = {}
    async with contextlib.aclosing(events):
        async for event in events:
            if event.usage is not None:
                usages[event.index] = event.usage
            if event.text or event.finish_reason:
                yield responses.completion_chunk(meta, event.index, event.text, event.finish_reason)
    if include_usage:
        yield responses.usage_chunk(meta, "text_completion", total_usage(usages, n))


async def chat_chunks(meta: Meta, events: AsyncIterator[TextEvent], indices: Sequence[int], n: int,
                      include_usage: bool) -> AsyncIterator[dict[str, Any]]:
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
                yield responses.chat_chunk(meta, event.index, delta, event.finish_reason)
    if include_usage:
        yield responses.usage_chunk(meta, "chat.completion.chunk", total_usage(usages, n))
