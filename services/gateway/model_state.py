"""What the gateway learns about the served model from the engine at run time (never written into config)."""

from __future__ import annotations

import logging

from steploop.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from steploop.common.pooling_params import PoolingConfig, unsupported_api_message
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError, bad_request

logger = logging.getLogger(__name__)


class ModelState:
    def __init__(self, engine: EngineClient, served_model_name: str, model_path: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.max_model_len = 0          # 0 = not known yet (engine not reachable, or no worker attached)
        self.vocab_size = 0
        self.runner = ""                # "generate" or "pooling" (embeddings); "" = not known yet
        self.pooling: PoolingConfig | None = None
        self.generation_defaults = NO_DEFAULTS   # the model's sampling defaults, once a worker has said them
        self.lora_adapters: dict[str, str] = {}   # LoRA adapters the engine serves: name -> folder
        self.weight_version: str | None = None    # the served weights' version, once an admin route learned it
        self.max_waiting = 0            # the engine's --max-waiting; 0 = not known yet

    async def refresh(self) -> None:
        info = await self.engine.model_info()
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.runner, self.pooling = info.runner, info.pooling
        self.lora_adapters = dict(info.lora_adapters)
        self.max_waiting = info.max_waiting
        if info.max_model_len and info.generation_defaults != self.generation_defaults:
            self.generation_defaults = info.generation_defaults
            logger.info("Using default sampling params from the model's generation config: %s",
                        self.generation_defaults.overridden())

    async def sampling_defaults(self) -> GenerationDefaults:
        """The defaults for the sampling fields a request leaves unset: asks the engine again while no worker has
        attached yet (a request before that gets the API's own defaults; an unreachable engine fails it anyway)."""
        if self.max_model_len == 0:
            await self.try_refresh()
        return self.generation_defaults

    async def refresh_adapters(self) -> None:
        """Before listing models: the engine's adapters now (another gateway may have loaded or unloaded one)."""
        await self.try_refresh()

    async def check_serves(self, runner: str, api: str) -> None:
        """A 400 in vLLM's words when the model's runner does not serve `api` ("Embeddings", "Chat Completions",
        ...). Unknown yet (no worker attached): the request goes on and the engine checks it itself."""
        if not self.max_model_len:
            await self.try_refresh()
        if self.runner and self.runner != runner:
            raise bad_request(unsupported_api_message(api), param="model", code="model_not_supported")

    def check_queueable(self, sequences: int, param: str) -> None:
        """A request of more sequences (prompts x n) than the engine ever queues would be a 503 on every retry:
        a 400 that says so instead. The choices of one prompt go to one replica (prefix affinity), so one
        replica's --max-waiting is the bound."""
        if self.max_waiting and sequences > self.max_waiting:
            raise bad_request(f"this request makes {sequences} sequences (prompts x n), more than the server "
                              f"ever queues (--max-waiting {self.max_waiting}); send them in smaller requests",
                              param=param)

    def tasks(self) -> list[str]:
        """What the model serves, for /v1/models: ["generate"] or ["embed"] (vLLM's task names)."""
        return {"generate": ["generate"], "pooling": ["embed"]}.get(self.runner, [])

    async def try_refresh(self) -> None:
        """At startup: the engine may not be up yet, which is not fatal; known_max_model_len asks again while it
        is unknown. Completions do not need it: the engine checks lengths and token ids itself."""
        try:
            await self.refresh()
        except APIError as err:
            logger.warning("engine model info not available yet (%s); will retry", err.message)

    async def known_max_model_len(self) -> int | None:
        """The context length for informational answers (model cards, /tokenize): asks the engine again while it is
        not known, and is None if it still is not (never an error)."""
        if self.max_model_len == 0:
            await self.try_refresh()
        return self.max_model_len or None
