"""A Messages reply from the text events of its one engine choice: the whole message, or Anthropic's stream

    message_start, ping, then per content block content_block_start, content_block_delta (text_delta /
    input_json_delta)..., content_block_stop; then message_delta (stop_reason, stop_sequence, usage), message_stop.

Tool calls come out of the same readers chat completions use (tools.ToolRequest.parse whole, outputs.ToolCallStream
streamed), translated from OpenAI's deltas into tool_use blocks. Usage follows Anthropic: input_tokens are the
prompt tokens not read from the prefix cache, cache_read_input_tokens those that were.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from steploop.common.engine_contract import Usage
from steploop.gateway.openai_api.outputs import ToolCallStream, chat_deltas
from steploop.gateway.openai_api.responses import Meta
from steploop.gateway.text.generation import TextEvent
from steploop.gateway.tool_parsers import ToolCall
from steploop.gateway.tool_parsers.tools import ToolRequest


def usage_dict(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish: str | None, stop_str: str | None, called: bool) -> str:
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_str is not None else "end_turn"


def _tool_use(call: ToolCall) -> dict[str, Any] | None:
    """A call as a tool_use block; None when its arguments are not a whole JSON object (cut by max_tokens)."""
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def thinking_block(text: str) -> dict[str, Any]:
    """--reasoning-parser's split. No signature: nothing here signs thinking (clients send it back unchanged)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _message(meta: Meta, content: list[dict[str, Any]], reason: str | None, stop_str: str | None,
             usage: Usage) -> dict[str, Any]:
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_str if reason == "stop_sequence" else None,
            "usage": usage_dict(usage)}


async def message_body(meta: Meta, events: AsyncIterator[TextEvent], tools: ToolRequest | None) -> dict[str, Any]:
    text, thinking, last = "", "", None
    async with contextlib.aclosing(events):
        async for event in events:
            text += event.text
            thinking += event.reasoning
            last = event
    content: list[dict[str, Any]] = [thinking_block(thinking)] if thinking else []
    blocks = []
    if tools is not None:
        words, calls = tools.parse(text)
        blocks = [b for b in map(_tool_use, calls) if b is not None]
        if blocks:
            text = words or ""
    if text:
        content.append({"type": "text", "text": text})
    content.extend(blocks)
    finish = last.finish_reason if last else None
    return _message(meta, content, stop_reason(finish, last.stop_str if last else None, bool(blocks)),
                    last.stop_str if last else None, (last.usage if last else None) or Usage())


class _Blocks:
    """Turns OpenAI-style deltas ({"content"} / {"tool_calls"}) into Anthropic's content block events."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None   # the open block's type
        self.called = False

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if delta.get("reasoning"):
            if self.open != "thinking":
                out += self._start(thinking_block(""))
            out.append(self._event("content_block_delta",
                                   delta={"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._event("content_block_delta", delta={"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            fn = call.get("function", {})
            if call.get("id"):
                self.called = True
                out += self._start({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}})
            if fn.get("arguments"):
                out.append(self._event("content_block_delta",
                                       delta={"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop")]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [self._event("content_block_start", content_block=block)]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "index": self.index, **fields}


async def message_events(meta: Meta, events: AsyncIterator[TextEvent], tools: ToolRequest | None,
                         prompt_tokens: int) -> AsyncIterator[dict[str, Any]]:
    """message_start waits for the first event, so an engine that fails at once still gets a real HTTP status."""
    blocks = _Blocks()
    calling = ToolCallStream(tools) if tools is not None else None
    started = False
    async with contextlib.aclosing(events):
        async for event in events:
            if not started:
                started = True
                yield {"type": "message_start", "message": _message(meta, [], None, None, Usage(prompt_tokens))}
                yield {"type": "ping"}
            for delta in chat_deltas(event, calling):
                for out in blocks.delta(delta):
                    yield out
            if event.finish_reason is not None:
                for out in blocks.close():
                    yield out
                reason = stop_reason(event.finish_reason, event.stop_str, blocks.called)
                yield {"type": "message_delta",
                       "delta": {"stop_reason": reason,
                                 "stop_sequence": event.stop_str if reason == "stop_sequence" else None},
                       "usage": usage_dict(event.usage or Usage())}
                yield {"type": "message_stop"}
