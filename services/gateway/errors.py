"""The one place where failures become OpenAI-shaped HTTP errors: `{"error": {message, type, param, code}}`.

gRPC status codes from the engine map here (INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED and UNAVAILABLE 503 with
Retry-After, anything else 500); handlers raise `APIError` and the middleware in app.py renders it. A response body never
carries a stack trace: unexpected exceptions are logged and answered with a generic 500.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from aiohttp import web

# Trailing-metadata keys the engine may set to refine an INVALID_ARGUMENT (or other) status.
ERROR_CODE_KEY = "steploop-error-code"      # e.g. "context_length_exceeded"
ERROR_PARAM_KEY = "steploop-error-param"    # e.g. "max_tokens"
RETRY_AFTER_KEY = "retry-after"             # seconds, for RESOURCE_EXHAUSTED / UNAVAILABLE


class APIError(Exception):
    """An error answered to the client as-is (its message must be safe to show)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()), content_type="application/json",
                            headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error() -> APIError:
    return APIError(500, "internal server error; see the gateway logs", type="server_error", code="internal_error")


def engine_unavailable(detail: str = "the engine is not reachable") -> APIError:
    return APIError(503, f"service unavailable: {detail}", type="server_error", code="engine_unavailable",
                    headers={"Retry-After": "1"})


def _metadata(err: grpc.aio.AioRpcError) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (err.trailing_metadata() or ()):
        if isinstance(value, str):
            out[key.lower()] = value
    return out


def from_grpc_error(err: grpc.aio.AioRpcError) -> APIError:
    """Maps an engine RPC failure to the HTTP error the client sees."""
    return from_status(err.code(), err.details() or "", _metadata(err))


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# gRPC's own words when a server stops with calls still open (its grace period over: a shutdown or restart).
_SERVER_STOPPED = ("Cancelling all calls",)


def from_request_error(err) -> APIError:
    """Maps the RequestError a Session stream ends one request with, as from_grpc_error maps a call's status."""
    meta = {ERROR_CODE_KEY: err.code} if err.code else {}
    if err.param:
        meta[ERROR_PARAM_KEY] = err.param
    if err.retry_after_s:
        meta[RETRY_AFTER_KEY] = str(err.retry_after_s)
    return from_status(_STATUS_CODES.get(err.status_code, grpc.StatusCode.UNKNOWN), err.message, meta)


def from_status(status: grpc.StatusCode, details: str, meta: dict[str, str]) -> APIError:
    param, code = meta.get(ERROR_PARAM_KEY), meta.get(ERROR_CODE_KEY)
    if status == grpc.StatusCode.INVALID_ARGUMENT:
        # The engine validated the request: its message is meant for the caller.
        return APIError(400, details or "invalid request", param=param, code=code or "invalid_value")
    if status == grpc.StatusCode.NOT_FOUND:            # a model / LoRA adapter that is not served
        return APIError(404, details or "not found", param=param, code=code or "model_not_found")
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:   # the waiting queue is full (--max-waiting)
        return APIError(503, f"the engine is at capacity, retry later: {details}".rstrip(": "),
                        type="server_error", code=code or "overloaded",
                        headers={"Retry-After": meta.get(RETRY_AFTER_KEY, "1")})
    if status == grpc.StatusCode.UNAVAILABLE:
        return engine_unavailable(_unavailable_reason(details, code))
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the engine did not answer in time", type="server_error", code="timeout")
    return internal_error()


def _unavailable_reason(details: str, code: str | None) -> str:
    """The engine's own UNAVAILABLE (no worker, shutting down) carries its error code and says what happened; a
    status without one is gRPC's, whose text ("Cancelling all calls", "failed to connect to all addresses; ...
    ipv4:...") tells a client nothing it can act on, so it is said in words here."""
    if code and details:
        return details
    if any(s in details for s in _SERVER_STOPPED):
        return "the engine stopped before this request finished (it was shut down or restarted); retry shortly"
    return "the engine is not reachable (down or restarting); retry shortly"
