"""The gateway's REST API as an OpenAPI 3.1 document, written by hand to match protocol.py's validation (ranges,
types, required fields) and its real limits, so generated clients and fuzzers send meaningful bodies. (The fuzzing
test narrows sizes itself, for speed on small machines; the document states what the server accepts.)"""

from __future__ import annotations

from typing import Any

from steploop.gateway.batch_api import openapi as batch_openapi
from steploop.gateway.embeddings_api import openapi as embeddings_openapi
from steploop.gateway.endpoints import control_openapi
from steploop.gateway.http_io.validation import MAX_INT32, MAX_UINT32
from steploop.gateway.messages_api import openapi as messages_openapi
from steploop.gateway.openai_api.beam_fields import MAX_BEAM_WIDTH
from steploop.gateway.openai_api.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_LOGPROBS, MAX_N
from steploop.gateway.openai_api.token_controls import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from steploop.gateway.openai_api.vllm_extras import MAX_CHOICES
from steploop.gateway.responses_api import openapi as responses_openapi

_NUM = {"type": "number"}
_CHOICES = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_CHOICES}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_GRAMMAR = {"type": "string", "minLength": 1}          # EBNF / GBNF with a `root` rule, as xgrammar reads it
_STRUCTURAL_TAG = {"oneOf": [{"type": "object"}, {"type": "string", "minLength": 2}]}   # xgrammar's, or its JSON text
_STOP = {"oneOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "items": {"type": "string", "minLength": 1}}]}
_RESPONSE_FORMAT = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                      "strict": {"type": "boolean"}}}}}

# Parameters both endpoints share (OpenAI's, then vLLM's extras). Bounds mirror protocol.parse_sampling.
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "temperature": {**_NUM, "minimum": 0, "maximum": 2},
    "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "seed": {"type": "integer", "minimum": 0},
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100},
                   "propertyNames": {"pattern": "^[0-9]+$"}},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
    "response_format": _RESPONSE_FORMAT,
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_INT32},
    "min_p": {**_NUM, "minimum": 0, "maximum": 1},
    "repetition_penalty": {**_NUM, "exclusiveMinimum": 0, "maximum": 2},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": MAX_UINT32},
    "ignore_eos": {"type": "boolean"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "include_stop_str_in_output": {"type": "boolean"},
    "skip_special_tokens": {"type": "boolean"},
    # vLLM's (vllm_extras.py); at most one of response_format, guided_json, guided_choice, guided_regex,
    # structured_outputs
    "truncate_prompt_tokens": {"oneOf": [{"type": "integer", "minimum": 1, "maximum": MAX_UINT32},
                                         {"type": "integer", "enum": [-1]}]},
    "guided_json": {"oneOf": [{"type": "object"}, {"type": "string"}]},
    "guided_choice": _CHOICES,
    "guided_regex": {"type": "string", "minLength": 1},
    "guided_grammar": _GRAMMAR,
    "structural_tag": _STRUCTURAL_TAG,
    # at most one key: json, json_object (true), choice, regex, grammar or structural_tag
    "structured_outputs": {"type": "object", "properties": {"json": {"type": "object"}, "json_object": {
        "type": "boolean"}, "choice": _CHOICES, "regex": {"type": "string", "minLength": 1}, "grammar": _GRAMMAR,
        "structural_tag": _STRUCTURAL_TAG}},
    # token controls (token_controls.py): ids must be < the model's vocabulary size
    "allowed_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
    "bad_words": {"type": ["array", "null"], "items": {"type": "string", "minLength": 1,
                                                       "maxLength": MAX_BAD_WORD_CHARS, "pattern": "\\S"},
                  "maxItems": MAX_BAD_WORDS},
    # logprob, rank and top k of each prompt token (not with stream)
    "prompt_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
    # beam search (beam_fields.py): best_of (default n) beams, the n best returned; not with stop, penalties,
    # logit_bias, token controls, a grammar, min_tokens, prompt_logprobs or echo
    "use_beam_search": {"type": ["boolean", "null"]},
    "best_of": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_BEAM_WIDTH},
    "length_penalty": {**_NUM, "minimum": -10, "maximum": 10},
    "early_stopping": {"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["never"]}]},
}
# Unset: what fits in the context. Prompt + max_tokens over the context is a 400 (context_length_exceeded).
_MAX_TOKENS = {"type": "integer", "minimum": 1}

_COMPLETION_REQUEST = {"type": "object", "required": ["prompt"], "properties": {
    **_SAMPLING,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                         _TOKEN_IDS,
                         {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]},
    "max_tokens": {"type": "integer", "minimum": 0, "default": COMPLETIONS_DEFAULT_MAX_TOKENS},
    "echo": {"type": "boolean"},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
}}

_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
# content may be null only on an assistant message that carries tool_calls; a tool message needs tool_call_id.
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"},
                          {"type": "array", "items": {
                              "type": "object", "required": ["type", "text"],
                              "properties": {"type": {"type": "string", "enum": ["text"]},
                                             "text": {"type": "string"}}}},
                          {"type": "null"}]},
    "tool_calls": {"type": "array", "items": _TOOL_CALL},
    "tool_call_id": {"type": "string"}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}
_TOOL_CHOICE = {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                          {"type": "object", "required": ["type", "function"], "properties": {
                              "type": {"type": "string", "enum": ["function"]},
                              "function": {"type": "object", "required": ["name"],
                                           "properties": {"name": {"type": "string"}}}}}]}

_CHAT_REQUEST = {"type": "object", "required": ["messages"], "properties": {
    **_SAMPLING,
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "max_tokens": _MAX_TOKENS,
    "max_completion_tokens": _MAX_TOKENS,
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    "add_generation_prompt": {"type": "boolean"},
    "continue_final_message": {"type": "boolean"},
    "chat_template_kwargs": {"type": "object"},
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": {"type": "boolean"},
}}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "choices": {"type": "array", "items": {"type": "object"}}, "usage": _USAGE}}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _responses(ok: dict, *, stream: bool = False) -> dict:
    content = {"application/json": {"schema": ok}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out = {"200": {"description": "OK", "content": content}}
    for code, why in (("400", "invalid request"), ("401", "missing or wrong API key"), ("404", "unknown model"),
                      ("413", "body too large"), ("503", "engine overloaded or unavailable (Retry-After)")):
        out[code] = {"description": why, "content": {"application/json": {"schema": _ERROR}}}
    return out


def openapi_spec(server_url: str = "http://127.0.0.1:8000", *, batch: bool = True,
                 control: bool = False) -> dict[str, Any]:
    """batch: the Batch API routes (when this gateway serves them); control: the engine control routes (only with
    --admin-api-key, behind the `admin` scheme)."""
    obj = {"type": "object"}
    schemes = {"bearer": {"type": "http", "scheme": "bearer"},
               "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    if control:
        schemes["admin"] = {"type": "http", "scheme": "bearer", "description": "the --admin-api-key"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "steploop", "version": "1",
                 "description": "OpenAI-compatible completions, chat completions, Responses and embeddings, "
                                "Anthropic's Messages, the Batch API (files, batches), plus vLLM's utility routes and, with "
                                "--admin-api-key, the engine control routes (pause, sleep, weight updates)."},
        "servers": [{"url": server_url}],
        "components": {"securitySchemes": schemes},
        "paths": {
            "/v1/completions": {"post": {"operationId": "createCompletion", "security": [{"bearer": []}, {}],
                                         "requestBody": _json_body(_COMPLETION_REQUEST),
                                         "responses": _responses(_COMPLETION, stream=True)}},
            "/v1/chat/completions": {"post": {"operationId": "createChatCompletion",
                                              "security": [{"bearer": []}, {}],
                                              "requestBody": _json_body(_CHAT_REQUEST),
                                              "responses": _responses(_COMPLETION, stream=True)}},
            "/v1/models": {"get": {"operationId": "listModels", "security": [{"bearer": []}, {}],
                                   "responses": _responses(obj)}},
            "/v1/models/{model}": {"get": {"operationId": "retrieveModel", "security": [{"bearer": []}, {}],
                                           "parameters": [{"name": "model", "in": "path", "required": True,
                                                           "schema": {"type": "string"}}],
                                           "responses": _responses(obj)}},
            "/tokenize": {"post": {"operationId": "tokenize", "requestBody": _json_body({
                "type": "object", "properties": {
                    "model": {"type": "string"}, "prompt": {"type": "string", "maxLength": 200},
                    "add_special_tokens": {"type": "boolean"},
                    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 4},
                    "add_generation_prompt": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}}),
                "responses": _responses({"type": "object", "required": ["count", "tokens"], "properties": {
                    "count": {"type": "integer"}, "tokens": {"type": "array", "items": {"type": "integer"}},
                    "max_model_len": {"type": ["integer", "null"]},
                    "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}})}},
            "/detokenize": {"post": {"operationId": "detokenize", "requestBody": _json_body({
                "type": "object", "required": ["tokens"],
                "properties": {"model": {"type": "string"}, "tokens": _TOKEN_IDS}}),
                "responses": _responses({"type": "object", "required": ["prompt"],
                                         "properties": {"prompt": {"type": "string"}}})}},
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "ready"}, "503": {"description": "not ready"}}}},
            "/version": {"get": {"operationId": "version", "responses": {"200": {
                "description": "OK", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}}}}},
            **messages_openapi.paths(_json_body),
            **responses_openapi.paths(_json_body, _responses),
            **embeddings_openapi.paths(_json_body, _responses),
            **(batch_openapi.paths(_json_body, _responses) if batch else {}),
            **(control_openapi.paths(_json_body, _responses) if control else {}),
        },
    }
