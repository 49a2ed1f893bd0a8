"""Which class a request's engine work runs in: interactive, or background for the Batch API's lines. The batch
runner sends each line to this gateway with `x-steploop-batch-id` (batch_api/runner.py); this middleware marks the
request's context, and the engine requests built for it carry `background` (engine.proto), so under every
scheduling policy they wait behind interactive requests and are preempted first (scheduler/policy.py). A client may
send the header too: it can only lower its own requests' class."""

from __future__ import annotations

import contextvars

from aiohttp import web

BATCH_HEADER = "x-steploop-batch-id"
_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("steploop_background", default=False)


def is_background() -> bool:
    """True while handling a Batch API line (tasks the handler starts inherit it)."""
    return _BACKGROUND.get()


@web.middleware
async def middleware(request: web.Request, handler) -> web.StreamResponse:
    if BATCH_HEADER not in request.headers:
        return await handler(request)
    token = _BACKGROUND.set(True)
    try:
        return await handler(request)
    finally:
        _BACKGROUND.reset(token)
