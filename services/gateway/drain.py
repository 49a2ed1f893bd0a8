"""Graceful drain: after SIGTERM the gateway keeps its socket open while in-flight requests finish, and answers
everything new with 503 + Retry-After (and closes that connection), so clients and load balancers get a clear
"go elsewhere" instead of a refused connection. /health turns 503 at once; /metrics keeps answering."""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.gateway.errors import APIError

EXEMPT = ("/health", "/metrics")   # probes and scrapes are neither refused nor waited for


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in EXEMPT:
            return await handler(request)
        if self.draining:
            response = APIError(503, "the server is shutting down; retry (on another replica)", type="server_error",
                                code="shutting_down", headers={"Retry-After": "1"}).to_response()
            response.force_close()   # the client's next request opens a fresh connection
            return response
        self.in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Refuses new requests from now on and waits up to `timeout` s for those in flight; returns how many are
        still running (the caller cancels them)."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.in_flight
