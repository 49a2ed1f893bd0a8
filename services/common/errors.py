"""Errors that cross a service boundary, mapped in this one place to gRPC status codes and HTTP statuses.

A servicer raises an EngineError; `abort_with` turns it into a gRPC status whose trailing metadata carries the
OpenAI error `code` and `param`, so the gateway can rebuild the same error for HTTP without guessing.
"""

from __future__ import annotations

import grpc

CODE_KEY = "steploop-error-code"
PARAM_KEY = "steploop-error-param"
RETRY_AFTER_KEY = "retry-after"      # seconds, on RESOURCE_EXHAUSTED (the gateway's Retry-After header)


class EngineError(Exception):
    grpc_status = grpc.StatusCode.INTERNAL
    http_status = 500
    default_code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code


class InvalidRequestError(EngineError):
    """The request can never be served as sent (bad parameter, too long for the context)."""
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    default_code = "invalid_request"


class NotFoundError(EngineError):
    """The model or LoRA adapter named is not served (HTTP 404 model_not_found, as OpenAI says it)."""
    grpc_status = grpc.StatusCode.NOT_FOUND
    http_status = 404
    default_code = "model_not_found"


class UnavailableError(EngineError):
    """No worker to run it, or the engine is shutting down; retrying later may succeed."""
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    default_code = "service_unavailable"


class OverloadedError(EngineError):
    """The waiting queue is full; retry after a short while."""
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 503
    default_code = "overloaded"


def trailing_metadata(err: EngineError) -> tuple[tuple[str, str], ...]:
    md = [(CODE_KEY, err.code)]
    if err.param:
        md.append((PARAM_KEY, err.param))
    if isinstance(err, OverloadedError):
        md.append((RETRY_AFTER_KEY, "1"))
    return tuple(md)


async def abort_with(context: grpc.aio.ServicerContext, err: EngineError) -> None:
    """Ends the call with err's status; raises (grpc's abort never returns)."""
    context.set_trailing_metadata(trailing_metadata(err))
    await context.abort(err.grpc_status, err.message)
