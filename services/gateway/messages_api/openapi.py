"""/v1/messages and /v1/messages/count_tokens in the gateway's OpenAPI document (bounds as protocol.py checks)."""

from __future__ import annotations

from typing import Any

_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_BLOCK = {"oneOf": [
    _TEXT_BLOCK,
    {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
        "type": {"type": "string", "enum": ["tool_use"]}, "id": {"type": "string"}, "name": {"type": "string"},
        "input": {"type": "object"}}},
    {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"type": "string", "enum": ["tool_result"]}, "tool_use_id": {"type": "string"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
        "is_error": {"type": "boolean"}}}]}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}}}
_TOOL = {"type": "object", "required": ["name", "input_schema"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}, "description": {"type": "string"},
    "input_schema": {"type": "object"}}}
_TOOL_CHOICE = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
    "disable_parallel_tool_use": {"type": "boolean"}}}
_CONVERSATION = {
    "model": {"type": "string"},
    "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": _TOOL_CHOICE,
}
MESSAGES_REQUEST = {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
    **_CONVERSATION,
    "max_tokens": {"type": "integer", "minimum": 1},
    "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "stream": {"type": "boolean"},
    "metadata": {"type": "object"},
    "cache_salt": {"type": "string"},
}}
COUNT_TOKENS_REQUEST = {"type": "object", "required": ["model", "messages"], "properties": _CONVERSATION}
ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"type": "string", "enum": ["error"]},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
MESSAGE = {"type": "object", "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
           "properties": {"id": {"type": "string"}, "type": {"type": "string"}, "role": {"type": "string"},
                          "content": {"type": "array", "items": {"type": "object"}}, "model": {"type": "string"},
                          "stop_reason": {"type": ["string", "null"]}, "stop_sequence": {"type": ["string", "null"]},
                          "usage": {"type": "object"}}}


def _responses(ok: dict[str, Any], stream: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": ok}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for code, why in (("400", "invalid request"), ("401", "missing or wrong API key (x-api-key or Bearer)"),
                      ("404", "unknown model"), ("413", "body too large"),
                      ("529", "engine overloaded or unavailable (Retry-After)")):
        out[code] = {"description": why, "content": {"application/json": {"schema": ERROR}}}
    return out


def paths(json_body) -> dict[str, Any]:
    security = [{"bearer": []}, {"x-api-key": []}, {}]
    return {
        "/v1/messages": {"post": {"operationId": "createMessage", "security": security,
                                  "requestBody": json_body(MESSAGES_REQUEST),
                                  "responses": _responses(MESSAGE, stream=True)}},
        "/v1/messages/count_tokens": {"post": {
            "operationId": "countMessageTokens", "security": security,
            "requestBody": json_body(COUNT_TOKENS_REQUEST),
            "responses": _responses({"type": "object", "required": ["input_tokens"],
                                     "properties": {"input_tokens": {"type": "integer"}}}, stream=False)}},
    }
