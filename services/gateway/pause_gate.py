"""PauseGate: while the engine is paused (POST /pause), new generation requests wait here for POST /resume, up to
--paused-request-timeout seconds, then get 503 engine_paused (0: at once). Requests already past the gate are the
engine's to abort, finish or keep (the pause mode). The scheduler holds requests that reach it while paused too (a
direct gRPC client, another gateway), so the gate is the bound, not the only guard."""

from __future__ import annotations

import asyncio

from steploop.gateway.errors import APIError


def engine_paused(detail: str) -> APIError:
    return APIError(503, f"the engine is paused (POST /resume ends it); {detail}", type="server_error",
                    code="engine_paused", headers={"Retry-After": "1"})


class PauseGate:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        if self._open.is_set():
            return
        if self.timeout <= 0:
            raise engine_paused("retry after it resumes")
        try:
            await asyncio.wait_for(self._open.wait(), self.timeout)
        except asyncio.TimeoutError:
            raise engine_paused(f"this request waited {self.timeout:g} s (--paused-request-timeout)") from None
