"""Readiness for /health: the engine says SERVING (grpc.health.v1) and has at least one worker attached.

Probes from load balancers arrive often; the answer is cached for `ttl` seconds and concurrent probes share one
check, so /health costs the engine at most two small RPCs per ttl.
"""

from __future__ import annotations

import asyncio
import time

from steploop.gateway.drain import Drain
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError


class HealthProbe:
    def __init__(self, engine: EngineClient, drain: Drain, ttl: float = 0.5) -> None:
        self._engine = engine
        self._drain = drain      # draining on shutdown: stop being routed to before we stop accepting
        self._ttl = ttl
        self._checked_at = -float("inf")
        self._ready = False
        self._lock = asyncio.Lock()

    async def ready(self) -> bool:
        if self._drain.draining:
            return False
        async with self._lock:
            if time.monotonic() - self._checked_at >= self._ttl:
                self._ready = await self._check()
                self._checked_at = time.monotonic()
            return self._ready

    async def _check(self) -> bool:
        try:
            serving, info = await asyncio.gather(self._engine.health(), self._engine.model_info())
        except APIError:
            return False
        return serving and info.num_workers >= 1
