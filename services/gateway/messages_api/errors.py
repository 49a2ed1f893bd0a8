"""Failures in Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`, with its status codes.

The gateway's own errors are APIErrors with OpenAI's statuses; here they are renamed. The engine at capacity
(its waiting queue full, code "overloaded") is Anthropic's 529 overloaded_error, which its SDK raises as
OverloadedError; the engine unreachable, restarting or shutting down stays a 503, its SDK's
ServiceUnavailableError. The SDK retries both, honouring Retry-After.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from steploop.gateway.errors import APIError

PATH_PREFIX = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
          429: "rate_limit_error", 500: "api_error", 503: "api_error", 504: "timeout_error",
          529: "overloaded_error"}
OVERLOADED = 529


def status_of(err: APIError) -> int:
    return OVERLOADED if err.status == 503 and err.code == "overloaded" else err.status


def error_event(err: APIError) -> dict[str, Any]:
    """The error as Anthropic's body (also the `error` event of a stream that failed after its 200)."""
    kind = _TYPES.get(status_of(err), "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def to_response(err: APIError) -> web.Response:
    return web.Response(status=status_of(err), text=json.dumps(error_event(err)), content_type="application/json",
                        headers=err.headers)
