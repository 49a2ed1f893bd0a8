"""Turns the merged `TextEvent`s of a request into what the client gets: streamed chunks or one whole body."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from steploop.common.engine_contract import Usage
from steploop.gateway.openai_api import responses
from steploop.gateway.openai_api.responses import Meta
from steploop.gateway.text.generation import TextEvent, total_usage
from steploop.gateway.text.logprobs import TokenInfo, chat_logprobs, completion_logprobs
from steploop.gateway.tool_parsers import ToolCall
from steploop.gateway.tool_parsers.tools import ToolRequest


@dataclass
class Collected:
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    usages: dict[int, Usage] = field(default_factory=dict)
    logprobs: dict[int, list[TokenInfo]] = field(default_factory=dict)   # only choices that asked
    reasoning: dict[int, str] = field(default_factory=dict)              # --reasoning-parser's split, if any
    prompt_logprobs: dict[int, list] = field(default_factory=dict)       # vLLM's, only choices that asked


async def collect(events: AsyncIterator[TextEvent]) -> Collected:
    out = Collected()
    async with contextlib.aclosing(events):
        async for event in events:
            out.texts[event.index] = out.texts.get(event.index, "") + event.text
            if event.reasoning:
                out.reasoning[event.index] = out.reasoning.get(event.index, "") + event.reasoning
            if event.logprobs is not None:
                out.logprobs.setdefault(event.index, []).extend(event.logprobs)
            if event.prompt_logprobs is not None:
                out.prompt_logprobs[event.index] = event.prompt_logprobs
            if event.finish_reason is not None:
                out.finish[event.index] = event.finish_reason
                out.usages[event.index] = event.usage or Usage()
    return out


async def completion_body(meta: Meta, events: AsyncIterator[TextEvent], n: int, logprobs: bool) -> dict[str, Any]:
    got = await collect(events)
    lps = {i: completion_logprobs(got.logprobs.get(i, ())) for i in got.texts} if logprobs else {}
    return responses.completion(meta, got.texts, got.finish, total_usage(got.usages, n), lps, got.prompt_logprobs)


async def chat_body(meta: Meta, events: AsyncIterator[TextEvent], n: int, logprobs: bool,
                    tools: ToolRequest | None = None, echo: str = "") -> dict[str, Any]:
    """`echo`: text each choice's content starts with (vLLM's chat `echo`)."""
    got = await collect(events)
    lps = {i: chat_logprobs(got.logprobs.get(i, ())) for i in got.texts} if logprobs else {}
    messages = {}
    for i, text in got.texts.items():
        messages[i] = {"role": "assistant", "content": text}
        if tools is not None:
            content, calls = tools.parse(text)
            if calls:
                messages[i] = {"role": "assistant", "content": content, "tool_calls": [c.to_dict() for c in calls]}
                got.finish[i] = tools.finish_reason(calls, got.finish.get(i))
        if echo:
            messages[i]["content"] = echo + (messages[i]["content"] or "")
        if i in got.reasoning:
            messages[i]["reasoning_content"] = got.reasoning[i]   # vLLM's field
    body = responses.chat_completion(meta, messages, got.finish, total_usage(got.usages, n), lps)
    if got.prompt_logprobs:      # vLLM's: one list for the request (every choice has the same prompt)
        body["prompt_logprobs"] = got.prompt_logprobs[min(got.prompt_logprobs)]
    return body


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
                      include_usage: bool, logprobs: bool = False, tools: ToolRequest | None = None,
                      echo: str = "") -> AsyncIterator[dict[str, Any]]:
    """Per choice: a first delta with the role, then content (or tool call) deltas, then one with finish_reason.
    The role deltas wait for the first event, so an engine that fails at once still gets a real HTTP status.
    `echo` (vLLM's chat `echo`) is one content delta per choice right after its role delta."""
    usages: dict[int, Usage] = {}
    calling = {index: ToolCallStream(tools) for index in indices} if tools is not None else {}
    started = False
    async with contextlib.aclosing(events):
        async for event in events:
            if not started:
                started = True
                first = {"role": "assistant", "content": "" if tools is None else None}   # null: it may only call
                for index in indices:
                    yield responses.chat_chunk(meta, index, first, None)
                    if echo:
                        yield responses.chat_chunk(meta, index, {"content": echo}, None)
            if event.usage is not None:
                usages[event.index] = event.usage
            if event.reasoning:
                yield responses.chat_chunk(meta, event.index, {"reasoning_content": event.reasoning}, None)
            if not (event.text or event.finish_reason):
                continue
            if calling:
                for delta, finish, infos in calling[event.index].feed(event):
                    lps = chat_logprobs(infos) if logprobs and (infos or finish) else None
                    yield responses.chat_chunk(meta, event.index, delta, finish, lps)
                continue
            delta = {"content": event.text} if event.text else {}
            lps = chat_logprobs(event.logprobs or ()) if logprobs else None
            yield responses.chat_chunk(meta, event.index, delta, event.finish_reason, lps)
    if include_usage:
        yield responses.usage_chunk(meta, "chat.completion.chunk", total_usage(usages, n))


class ToolCallStream:
    """One streamed choice of a request that may call tools: (delta, finish_reason, token infos) to send per event.

    auto: the format's CallSplitter turns the reply into content deltas and calls as OpenAI streams them (a first
    delta with index, id, type and name, then the arguments in pieces as they are written). A named function: its
    arguments stream as they are written (the grammar keeps them valid JSON). required: the JSON array is parsed at
    the end. Token logprobs ride on the next delta sent."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.splitter = tools.splitter() if tools.choice == "auto" else None
        self.text = ""                                  # required: the whole reply, parsed at its end
        self.pending: list[TokenInfo] = []
        self.named_call = ToolCall(tools.parser.new_call_id(), tools.named, "") if tools.choice == "named" else None
        self.named_started = False

    def feed(self, event: TextEvent) -> list[tuple[dict[str, Any], str | None, list[TokenInfo]]]:
        self.pending.extend(event.logprobs or ())
        out: list[tuple[dict[str, Any], str | None, list[TokenInfo]]] = []
        if self.named_call is not None:
            if not self.named_started:
                self.named_started = True
                out.append(self._calls_delta([self.named_call]))
            if event.text:
                out.append(({"tool_calls": [{"index": 0, "function": {"arguments": event.text}}]}, None,
                            self._take()))
            if event.finish_reason:
                out.append(({}, event.finish_reason, self._take()))
            return out
        if self.splitter is not None:
            deltas = self.splitter.feed(event.text)
            if event.finish_reason:
                deltas += self.splitter.finish()
            out += [(delta, None, self._take()) for delta in deltas]
            if event.finish_reason:
                _, calls = self.splitter.result()
                out.append(({}, self.tools.finish_reason(calls, event.finish_reason), self._take()))
            return out
        self.text += event.text
        if event.finish_reason:
            _, calls = self.tools.parse(self.text)
            if calls:
                out.append(self._calls_delta(calls))
                out.append(({}, self.tools.finish_reason(calls, event.finish_reason), self._take()))
            else:
                out.append(({"content": self.text} if self.text else {}, event.finish_reason, self._take()))
        return out

    def _calls_delta(self, calls: list[ToolCall]) -> tuple[dict[str, Any], None, list[TokenInfo]]:
        return {"tool_calls": [{"index": j, **call.to_dict()} for j, call in enumerate(calls)]}, None, self._take()

    def _take(self) -> list[TokenInfo]:
        taken, self.pending = self.pending, []
        return taken


def chat_deltas(event: TextEvent, calling: ToolCallStream | None) -> list[dict[str, Any]]:
    """The chat-shaped deltas one event carries, reasoning first: what the Messages and Responses streams translate
    into their own events (finish reasons and token infos are theirs to read from the event)."""
    deltas = calling.feed(event) if calling is not None else [({"content": event.text}, None, ())]
    return [{"reasoning": event.reasoning}, *(delta for delta, _, _ in deltas)]
