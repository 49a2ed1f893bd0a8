"""Graceful drain: after SIGTERM the gateway keeps its socket open while in-flight requests finish, and answers
everything new with 503 + Retry-After (and closes that connection), so clients and load balancers get a clear
"go elsewhere" instead of a refused connection. /health turns 503 at once; /metrics keeps answering.

What still runs when the drain time is over is cut, but never silently: each handler is cancelled and marked,
so a stream ends with a `shutting_down` error event and its trailer ([DONE]) as an engine failure does (sse.py),
and a request that has not answered yet gets a 503. A client can tell that from a network fault."""

from __future__ import annotations

import asyncio
import weakref

from aiohttp import web

from steploop.gateway.errors import APIError

EXEMPT = ("/health", "/metrics")   # probes and scrapes are neither refused nor waited for
# handler tasks cancelled by a drain deadline -> the error to tell their clients
_CUT: weakref.WeakKeyDictionary[asyncio.Task, APIError] = weakref.WeakKeyDictionary()


def shutting_down(detail: str = "retry (on another replica)") -> APIError:
    return APIError(503, f"the server is shutting down; {detail}", type="server_error", code="shutting_down",
                    headers={"Retry-After": "1"})


def cut_by_drain() -> APIError | None:
    """Called on a CancelledError: the error to send if the cancellation was the drain deadline (the caller
    then handles it), None if it was anything else (a client that went away, a second signal: re-raise)."""
    task = asyncio.current_task()
    error = _CUT.pop(task, None) if task is not None else None
    if error is not None and hasattr(task, "uncancel"):   # 3.11+: the cancellation is handled, not pending
        task.uncancel()
    return error


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.timeout = 0.0
        self._tasks: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in EXEMPT:
            return await handler(request)
        if self.draining:
            response = shutting_down().to_response()
            response.force_close()   # the client's next request opens a fresh connection
            return response
        task = asyncio.current_task()
        self.in_flight += 1
        self._tasks.add(task)
        self._idle.clear()
        try:
            return await handler(request)
        except asyncio.CancelledError:
            error = cut_by_drain()
            if error is None:
                raise
            response = error.to_response()   # cut before it answered: the 503 is still ours to send
            response.force_close()
            return response
        finally:
            self._tasks.discard(task)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Refuses new requests from now on and waits up to `timeout` s for those in flight; returns how many are
        still running (the caller cuts them)."""
        self.draining = True
        self.timeout = timeout
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.in_flight

    async def cut(self, grace: float = 2.0) -> int:
        """Cancels every request still in flight, marked as cut by the deadline, and waits up to `grace` s for
        them to write their error; returns how many did not finish within it (the server's cleanup kills them)."""
        error = shutting_down(f"this request was still running when the drain time (--shutdown-timeout "
                              f"{self.timeout:g} s) ran out; retry it")
        for task in list(self._tasks):
            _CUT[task] = error
            task.cancel()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except asyncio.TimeoutError:
            pass
        return self.in_flight
