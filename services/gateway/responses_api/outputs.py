"""A Response object from the text events of its one engine choice, whole or as the Responses event stream:

    response.created, response.in_progress; per output item response.output_item.added, then for a message
    response.content_part.added, response.output_text.delta..., response.output_text.done,
    response.content_part.done, or for a call response.function_call_arguments.delta..., ...done;
    response.output_item.done; finally response.completed (or response.incomplete when max_output_tokens cut it).

Every event carries a sequence_number. Tool calls come out of the readers chat completions uses
(tools.ToolRequest.parse, outputs.ToolCallStream), translated from chat deltas into function_call items.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from steploop.common.engine_contract import Usage
from steploop.gateway.openai_api.outputs import ToolCallStream, chat_deltas
from steploop.gateway.text.generation import TextEvent
from steploop.gateway.tool_parsers import ToolCall
from steploop.gateway.tool_parsers.tools import ToolRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseMeta:
    id: str
    model: str
    echo: dict[str, Any]                    # request fields repeated on the Response
    previous_response_id: str | None
    store: bool
    created_at: int = field(default_factory=lambda: int(time.time()))


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def response_object(meta: ResponseMeta, output: list[dict[str, Any]], status: str,
                    usage: Usage | None) -> dict[str, Any]:
    return {"id": meta.id, "object": "response", "created_at": meta.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": meta.model, "output": output, "previous_response_id": meta.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": meta.store, "truncation": "disabled",
            "usage": usage_dict(usage) if usage is not None else None, **meta.echo}


def message_item(text: str, status: str = "completed", id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": id or item_id("msg"), "status": status, "role": "assistant",
            "content": content}


def reasoning_item(text: str, status: str = "completed", id: str | None = None) -> dict[str, Any]:
    """--reasoning-parser's split, as the model's own reasoning text (no summary is written)."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": id or item_id("rs"), "summary": [], "content": content, "status": status}


def call_item(call: ToolCall, status: str = "completed", id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": id or item_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


async def response_body(meta: ResponseMeta, events: AsyncIterator[TextEvent],
                        tools: ToolRequest | None) -> dict[str, Any]:
    text, thinking, last = "", "", None
    async with contextlib.aclosing(events):
        async for event in events:
            text += event.text
            thinking += event.reasoning
            last = event
    calls: list[ToolCall] = []
    if tools is not None:
        words, calls = tools.parse(text)
        if calls:
            text = words or ""
    output = ([reasoning_item(thinking)] if thinking else []) + ([message_item(text)] if text or not calls else [])
    output += [call_item(c) for c in calls]
    finish = last.finish_reason if last else None
    return response_object(meta, output, status_of(finish), last.usage if last else None)


class _Items:
    """Chat-style deltas ({"content"} / {"tool_calls"}) as Responses output-item events, numbered in order."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []   # finished items, for the final Response
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if delta.get("reasoning"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start(reasoning_item("", "in_progress"))
            self.text += delta["reasoning"]
            out.append(self._at("response.reasoning_text.delta", content_index=0, delta=delta["reasoning"]))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._start(message_item("", "in_progress"))
                out.append(self._part_event("response.content_part.added", ""))
            self.text += delta["content"]
            out.append(self._at("response.output_text.delta", content_index=0, delta=delta["content"]))
        for call in delta.get("tool_calls", ()):
            fn = call.get("function", {})
            if call.get("id"):
                out += self._start(call_item(ToolCall(call["id"], fn["name"], ""), "in_progress"))
            if fn.get("arguments"):
                self.text += fn["arguments"]
                out.append(self._at("response.function_call_arguments.delta", delta=fn["arguments"]))
        return out

    def close(self) -> list[dict[str, Any]]:
        item, text = self.open, self.text
        if item is None:
            return []
        self.open, self.text = None, ""
        if item["type"] == "message":
            done = message_item(text, id=item["id"])
            out = [self._at("response.output_text.done", content_index=0, text=text, item=item),
                   self._part_event("response.content_part.done", text, item)]
        elif item["type"] == "reasoning":
            done = reasoning_item(text, id=item["id"])
            out = [self._at("response.reasoning_text.done", content_index=0, text=text, item=item)]
        else:
            done = {**item, "arguments": text, "status": "completed"}
            out = [self._at("response.function_call_arguments.done", arguments=text, item=item)]
        self.output.append(done)
        return out + [self.event("response.output_item.done", output_index=len(self.output) - 1, item=done)]

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.open = item
        return out + [self.event("response.output_item.added", output_index=len(self.output), item=item)]

    def _at(self, kind: str, item: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        item = item or self.open
        return self.event(kind, item_id=item["id"], output_index=len(self.output), **fields)

    def _part_event(self, kind: str, text: str, item: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._at(kind, item, content_index=0, part={"type": "output_text", "text": text, "annotations": []})


async def response_events(meta: ResponseMeta, events: AsyncIterator[TextEvent], tools: ToolRequest | None,
                          on_done: Callable[[dict[str, Any]], None]) -> AsyncIterator[dict[str, Any]]:
    """`on_done` gets the final Response before the last event goes out (so it is stored before the client can
    chain on it). response.created waits for the first event, so an engine that fails at once still gets a real
    HTTP status."""
    items = _Items()
    calling = ToolCallStream(tools) if tools is not None else None
    started = False
    async with contextlib.aclosing(events):
        async for event in events:
            if not started:
                started = True
                for kind in ("response.created", "response.in_progress"):
                    yield items.event(kind, response=response_object(meta, [], "in_progress", None))
            for delta in chat_deltas(event, calling):
                for out in items.delta(delta):
                    yield out
            if event.finish_reason is not None:
                for out in items.close():
                    yield out
                status = status_of(event.finish_reason)
                final = response_object(meta, items.output, status, event.usage)
                on_done(final)
                yield items.event(f"response.{status}", response=final)
