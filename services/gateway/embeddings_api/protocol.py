"""The /v1/embeddings request parser: OpenAI's fields, each checked, with errors naming the field.

`input` is a string, an array of strings, an array of token ids, or an array of token-id arrays (at most
MAX_INPUTS items, as OpenAI). `encoding_format` is "float" (default) or "base64" (little-endian float32, as
OpenAI's SDK decodes it). `dimensions` is checked against the model's pooling config (Matryoshka) by the route.
`user` is accepted and ignored, as OpenAI's is for serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v

MAX_INPUTS = 2048                        # OpenAI's limit on the number of inputs per request
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]   # texts (tokenized by the route) or token ids, in order
    encoding_format: str
    dimensions: int | None
    user: str | None


def _empty(what: str) -> Exception:
    return bad_request(f"'input' {what}", param="input", code="empty_input")


def _parse_inputs(value: Any, vocab_size: int | None) -> tuple[str | tuple[int, ...], ...]:
    if value is None:
        raise bad_request("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise v.type_error("input", "a string, an array of strings, an array of token ids, or an array of "
                           "token-id arrays", value)
    if not value:
        raise _empty("must not be an empty array")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"'input' has {len(value)} items; at most {MAX_INPUTS} are allowed", param="input")
    if all(isinstance(p, str) for p in value):
        if "" in value:
            raise _empty(f"item {value.index('')} is an empty string")
        return tuple(value)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return (v.get_token_ids(value, "input", vocab_size),)
    if all(isinstance(p, list) for p in value):
        if [] in value:
            raise _empty(f"item {value.index([])} is an empty token array")
        return tuple(v.get_token_ids(p, "input", vocab_size) for p in value)
    raise v.type_error("input", "a string, an array of strings, an array of token ids, or an array of token-id "
                       "arrays (not a mix)", value)


def parse_embeddings(body: Any, vocab_size: int | None) -> EmbeddingsRequest:
    body = v.require_object(body)
    encoding = v.get_str(body, "encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise bad_request(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got {encoding!r}",
                          param="encoding_format")
    return EmbeddingsRequest(model=v.get_str(body, "model"), inputs=_parse_inputs(body.get("input"), vocab_size),
                             encoding_format=encoding,
                             dimensions=v.get_int(body, "dimensions", None, lo=1, hi=v.MAX_UINT32),
                             user=v.get_str(body, "user"))
