"""OpenAI response objects, as plain dicts: whole responses and streamed chunks, for both endpoints.
Pure functions of the request's identity (`Meta`) and the generated text; no I/O here."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from steploop.common.engine_contract import Usage


@dataclass(frozen=True)
class Meta:
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def new_id(prefix: str) -> str:
    """`cmpl-…` / `chatcmpl-…`; also the engine request id's stem (suffixed with the choice index)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object (the Responses and Messages APIs name the same counts their own way)."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _envelope(meta: Meta, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": choices}


# /v1/completions

def completion(meta: Meta, texts: dict[int, str], finish: dict[int, str | None], usage: Usage,
               logprobs: dict[int, dict] | None = None,
               prompt_logprobs: dict[int, list] | None = None) -> dict[str, Any]:
    """prompt_logprobs: vLLM's, per choice index, for the choices of a request that asked."""
    logprobs = logprobs or {}
    choices = [{"index": i, "text": texts[i], "logprobs": logprobs.get(i), "finish_reason": finish.get(i)}
               for i in sorted(texts)]
    if prompt_logprobs:
        for choice in choices:
            choice["prompt_logprobs"] = prompt_logprobs.get(choice["index"])
    return {**_envelope(meta, "text_completion", choices), "usage": usage_dict(usage)}


def completion_chunk(meta: Meta, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict[str, Any]:
    return _envelope(meta, "text_completion",
                     [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])


# /v1/chat/completions

def chat_completion(meta: Meta, messages: dict[int, dict[str, Any]], finish: dict[int, str | None], usage: Usage,
                    logprobs: dict[int, dict] | None = None) -> dict[str, Any]:
    """messages: per choice index, {"role": "assistant", "content": ...} (plus "tool_calls" when it called)."""
    logprobs = logprobs or {}
    choices = [{"index": i, "message": messages[i], "logprobs": logprobs.get(i), "finish_reason": finish.get(i)}
               for i in sorted(messages)]
    return {**_envelope(meta, "chat.completion", choices), "usage": usage_dict(usage)}


def chat_chunk(meta: Meta, index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
    return _envelope(meta, "chat.completion.chunk",
                     [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])


def usage_chunk(meta: Meta, obj: str, usage: Usage) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk before [DONE], with no choices."""
    return {**_envelope(meta, obj, []), "usage": usage_dict(usage)}
