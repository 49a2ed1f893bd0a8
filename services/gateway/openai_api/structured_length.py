"""Structured output that ends by length: a grammar-constrained reply (response_format json_schema / json_object,
or a forced tool call) cut by max_tokens is invalid JSON, which the client's parser (the SDK's `parse()`) rejects
with little to go on. Small models often loop inside a grammar (digits without end) until max_tokens. The
response already says finish_reason "length"; the gateway's log says why and what to do."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from steploop.gateway.openai_api.protocol import SamplingFields
from steploop.gateway.text.generation import TextEvent
from steploop.gateway.tool_parsers.tools import ToolRequest

logger = logging.getLogger("steploop.gateway")

HINT = ("the model ran out of max_tokens inside the grammar, so the reply is cut and not valid JSON; raise "
        "max_tokens, or use a larger model (small ones can loop inside a grammar)")


def structured_kind(sampling: SamplingFields, tools: ToolRequest | None = None) -> str | None:
    """What constrains the reply, in the request's own terms; None when nothing does."""
    if tools is not None and tools.choice in ("required", "named"):
        return f"tool_choice {tools.choice if tools.choice == 'required' else repr(tools.named)}"
    if sampling.json_schema:
        return "response_format json_schema"
    if sampling.json_object:
        return "response_format json_object"
    if sampling.regex or sampling.grammar or sampling.structural_tag:
        return sampling.constrained_by or "guided_choice"
    return None


def log_length_finishes(events: AsyncIterator[TextEvent], request_id: str,
                        kind: str | None) -> AsyncIterator[TextEvent]:
    """`events` unchanged; a structured choice that ends by length is logged with the hint."""
    return events if kind is None else _watch(events, request_id, kind)


async def _watch(events: AsyncIterator[TextEvent], request_id: str, kind: str) -> AsyncIterator[TextEvent]:
    async with contextlib.aclosing(events):
        async for event in events:
            if event.finish_reason == "length":
                tokens = event.usage.completion_tokens if event.usage is not None else 0
                logger.warning("%s choice %d: structured output (%s) finished by length after %d tokens: %s",
                               request_id, event.index, kind, tokens, HINT)
            yield event
