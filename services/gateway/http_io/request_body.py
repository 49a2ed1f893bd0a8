"""A request's JSON body, read once for every handler: invalid JSON and lone UTF-16 surrogates are 400s."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from steploop.gateway.errors import bad_request


async def read_json(request: web.Request) -> Any:
    raw = await request.read()   # over the app's client_max_size: HTTPRequestEntityTooLarge, a 413 in app.py
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if b"\\ud" in raw or b"\\uD" in raw:   # only a \uD800-\uDFFF escape can put a lone surrogate in a str
        _refuse_lone_surrogates(body, "")
    return body


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
