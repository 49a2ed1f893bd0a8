"""/v1/embeddings in the gateway's OpenAPI document (bounds as protocol.py checks)."""

from __future__ import annotations

from typing import Any

from steploop.gateway.embeddings_api.protocol import ENCODING_FORMATS, MAX_INPUTS

_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
EMBEDDINGS_REQUEST = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string"},
    "input": {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_INPUTS},
        _TOKENS,
        {"type": "array", "items": _TOKENS, "minItems": 1, "maxItems": MAX_INPUTS}]},
    "encoding_format": {"type": "string", "enum": list(ENCODING_FORMATS), "default": "float",
                        "description": "base64: the little-endian float32 bytes of each vector, base64-encoded"},
    "dimensions": {"type": "integer", "minimum": 1,
                   "description": "Matryoshka truncation; refused unless the model's config.json allows it"},
    "user": {"type": "string"},
}}
EMBEDDINGS_RESPONSE = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                        "properties": {"object": {"type": "string"}, "index": {"type": "integer"},
                                                       "embedding": {"oneOf": [
                                                           {"type": "array", "items": {"type": "number"}},
                                                           {"type": "string"}]}}}},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
              "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}},
}}


def paths(json_body, responses) -> dict[str, Any]:
    return {"/v1/embeddings": {"post": {
        "operationId": "createEmbedding", "security": [{"bearer": []}, {}],
        "description": "Served by a worker started with --runner pooling; a generate model answers 400.",
        "requestBody": json_body(EMBEDDINGS_REQUEST), "responses": responses(EMBEDDINGS_RESPONSE)}}}
