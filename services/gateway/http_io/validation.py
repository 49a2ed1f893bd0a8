"""Typed field readers for JSON request bodies. Each raises a 400 naming the offending field (`param`), so
handlers and protocol.py never build error messages by hand. A JSON null means "not given" everywhere."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import unquote

from steploop.gateway.errors import bad_request

_MISSING = object()
# The Engine API's integer fields (engine.proto): token counts are uint32, top_k and logprobs int32. A larger
# JSON integer would fail in the protobuf encoder, after validation, as a 500.
MAX_UINT32, MAX_INT32 = 2**32 - 1, 2**31 - 1


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}", code="invalid_type")
    return body


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def type_error(name: str, expected: str, value: Any, param: str | None = None) -> Exception:
    return bad_request(f"'{name}' must be {expected}, got {json_type(value)}", param=param or name,
                       code="invalid_type")


def get_number(body: dict[str, Any], name: str, default: float | None, *, lo: float | None = None,
               hi: float | None = None, lo_exclusive: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise type_error(name, "a finite number", value)
    low_bad = lo is not None and (value <= lo if lo_exclusive else value < lo)
    if low_bad or (hi is not None and value > hi):
        left = "(" if lo_exclusive else "["
        raise bad_request(f"'{name}' must be in {left}{lo}, {hi}], got {value}", param=name)
    return float(value)


def get_int(body: dict[str, Any], name: str, default: int | None, *, lo: int | None = None,
            hi: int | None) -> int | None:
    """hi has no default: every integer that reaches the wire needs its field's bound (MAX_UINT32, MAX_INT32);
    None only for one that never leaves the gateway."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, "an integer", value)
    if lo is not None and value < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {value}", param=name)
    return value


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(name, "a boolean", value)
    return value


def get_str(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise type_error(name, "a string", value)
    return value


def get_object(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise type_error(name, "an object", value)
    return value


def get_stop(body: dict[str, Any], name: str = "stop") -> tuple[str, ...]:
    """`stop`: a string or a list of non-empty strings."""
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise type_error(name, "a string or an array of strings", value)
    if any(s == "" for s in items):
        raise bad_request(f"'{name}' must not contain empty strings", param=name)
    return tuple(items)


def get_token_ids(value: Any, name: str, vocab_size: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise type_error(name, "an array of integer token ids", value)
    upper = vocab_size if vocab_size else 2**32
    bad = [t for t in value if not 0 <= t < upper]
    if bad:
        raise bad_request(f"'{name}' has token ids out of range [0, {upper}): {bad[:5]}", param=name)
    return tuple(value)


def check_json_schema(schema: dict[str, Any], where: str, param: str) -> None:
    """An invalid schema is the caller's error (400), caught here: the worker could only fall back to 'any JSON'."""
    import jsonschema  # noqa: PLC0415 - only requests with a schema pay for the import

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(f"'{where}' is not a valid JSON schema: {exc.message}", param=param) from None
    for ref in _refs(schema):   # the worker's grammar compiler resolves only refs inside the schema itself
        if not ref.startswith("#") or _pointer(schema, ref[1:]) is _MISSING:
            raise bad_request(f"'{where}' has a $ref that does not resolve inside the schema: {ref!r} (only local "
                              "refs such as '#/$defs/Name' are supported)", param=param)


def _refs(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _pointer(document: Any, pointer: str) -> Any:
    """RFC 6901 JSON pointer ("" is the document itself); _MISSING when it leads nowhere."""
    node = document
    for part in unquote(pointer).split("/")[1:] if pointer else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node
