"""/v1/responses and /v1/responses/{response_id} in the gateway's OpenAPI document (bounds as protocol.py checks)."""

from __future__ import annotations

from typing import Any

_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
_ITEM = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _PART}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"type": "string", "enum": ["function_call"]}, "call_id": {"type": "string"},
        "name": {"type": "string"}, "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"type": "string", "enum": ["function_call_output"]}, "call_id": {"type": "string"},
        "output": {"type": "string"}}}]}
_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"},
    "description": {"type": "string"}, "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
_FORMAT = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}, "name": {"type": "string"},
    "schema": {"type": "object"}, "strict": {"type": "boolean"}}}
RESPONSES_REQUEST = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string"},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _ITEM, "minItems": 1}]},
    "instructions": {"type": "string"},
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "seed": {"type": "integer", "minimum": 0},
    "stream": {"type": "boolean"},
    "store": {"type": "boolean", "default": True},
    "previous_response_id": {"type": "string"},
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                              {"type": "object", "required": ["type", "name"], "properties": {
                                  "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}}}]},
    "parallel_tool_calls": {"type": "boolean"},
    "text": {"type": "object", "properties": {"format": _FORMAT}},
    "metadata": {"type": "object"},
    "user": {"type": "string"},
    "cache_salt": {"type": "string"},
}}
RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created_at": {"type": "integer"},
                           "status": {"type": "string"}, "model": {"type": "string"},
                           "output": {"type": "array", "items": {"type": "object"}},
                           "usage": {"type": ["object", "null"]}}}


def paths(json_body, responses) -> dict[str, Any]:
    security = [{"bearer": []}, {}]
    id_param = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    deleted = {"type": "object", "required": ["id", "deleted"],
               "properties": {"id": {"type": "string"}, "deleted": {"type": "boolean"}}}
    return {
        "/v1/responses": {"post": {"operationId": "createResponse", "security": security,
                                   "requestBody": json_body(RESPONSES_REQUEST),
                                   "responses": responses(RESPONSE, stream=True)}},
        "/v1/responses/{response_id}": {
            "get": {"operationId": "retrieveResponse", "security": security, "parameters": id_param,
                    "responses": responses(RESPONSE)},
            "delete": {"operationId": "deleteResponse", "security": security, "parameters": id_param,
                       "responses": responses(deleted)}},
    }
