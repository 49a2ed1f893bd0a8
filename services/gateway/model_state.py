"""What the gateway learns about the served model from the engine at run time (never written into config)."""

from __future__ import annotations

import asyncio
import logging

from services.gateway.engine_client import EngineClient
from services.gateway.errors import APIError, engine_unavailable

logger = logging.getLogger(__name__)


class ModelState:
    def __init__(self, engine: EngineClient, served_model_name: str, model_path: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.max_model_len = 0          # 0 = not known yet (engine not reachable, or no worker attached)
        self.vocab_size = 0
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        info = await self.engine.model_info()
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size

    async def try_refresh(self) -> None:
        """At startup: the engine may not be up yet, which is not fatal; requests refresh again."""
        try:
            await self.refresh()
        except APIError as err:
            logger.warning("engine model info not available yet (%s); will retry per request", err.message)

    async def known_max_model_len(self) -> int | None:
        """The context length for informational answers (model cards, /tokenize): asks the engine again while it is
        not known, and is None if it still is not (never an error)."""
        if self.max_model_len == 0:
            await self.try_refresh()
        return self.max_model_len or None

    async def require_max_model_len(self) -> int:
        if self.max_model_len == 0:
            async with self._lock:   # one refresh for a burst of requests, not one each
                if self.max_model_len == 0:
                    await self.refresh()
        if self.max_model_len == 0:
            raise engine_unavailable("the engine has no model length yet (no worker attached)")
        return self.max_model_len
