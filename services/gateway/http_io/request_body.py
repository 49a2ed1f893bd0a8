"""A request's JSON body, read once for every handler: invalid JSON, JSON nested too deeply for the handlers and
lone UTF-16 surrogates are 400s."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from steploop.gateway.errors import bad_request

# Deeper than any real request (a JSON schema in a tool or response_format nests a few dozen levels at most); the
# validators and schema compilers walk bodies recursively, so a deeper one would exhaust Python's stack there.
MAX_JSON_DEPTH = 128


async def read_json(request: web.Request) -> Any:
    raw = await request.read()   # over the app's client_max_size: HTTPRequestEntityTooLarge, a 413 in app.py
    return parse_json_body(raw)


def parse_json_body(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError:   # the C scanner recurses per nesting level
        raise _too_deep() from None
    except ValueError as err:   # JSONDecodeError, UnicodeDecodeError, and an integer literal over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if _depth_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    if b"\\ud" in raw or b"\\uD" in raw:   # only a \uD800-\uDFFF escape can put a lone surrogate in a str
        _refuse_lone_surrogates(body, "")
    return body


def _too_deep():
    return bad_request(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json")


def _depth_exceeds(body: Any, limit: int) -> bool:
    """Iterative, so the check itself cannot run out of stack."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _refuse_lone_surrogates(value: Any, path: str) -> None:
    """JSON may escape half of a UTF-16 pair ("\\ud83d" alone); Python keeps it, the tokenizer cannot encode it."""
    if isinstance(value, str):
        if any("\ud800" <= ch <= "\udfff" for ch in value):
            top = path.split(".")[0].split("[")[0] or None
            raise bad_request(f"'{path}' contains a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape); "
                              "text must be valid Unicode", param=top, code="invalid_unicode")
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_lone_surrogates(item, f"{path}[{i}]")
