"""LoraRegistry: the adapters this scheduler serves (name -> PEFT folder), checked when they are registered.

--lora-modules are read at start-up (a bad one stops the service with its reason); load_lora_adapter adds one
at run time. Checks: services/common/lora_adapter.py, against the model shapes the worker sent in its hello
(before a worker attached only what the folder alone says; the shapes are checked again when it attaches).
An unloaded adapter is refused for new requests at once; the worker forgets it once no live request uses it
(LoraSteps.fill_plan reads `unloaded`).
"""

from __future__ import annotations

import logging

from steploop.common.errors import InvalidRequestError, NotFoundError
from steploop.common.lora_adapter import LoraAdapterError, LoraModelShapes, read_adapter
from steploop.common.lora_config import LoraConfig, LoraModule

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.adapters: dict[str, str] = {}            # name -> folder, in registration order
        self.unloaded: set[str] = set()               # unregistered; the worker still may hold them
        self._also_unloaded: list[set[str]] = []      # the same for other worker groups (a P/D prefill group)
        self.shapes: LoraModelShapes | None = None    # from the worker's hello
        for module in config.lora_modules:            # checked by ServerConfig.validate at start-up
            self.adapters[module.name] = module.path

    def track_unloads(self) -> set[str]:
        """A set of unloaded adapters kept like `unloaded`, for another worker group's LoraSteps (each group's
        steps take what they dropped out of their own set)."""
        tracked = set(self.unloaded)
        self._also_unloaded.append(tracked)
        return tracked

    @property
    def modules(self) -> list[LoraModule]:
        return [LoraModule(n, p) for n, p in self.adapters.items()]

    def attach(self, shapes: LoraModelShapes | None) -> None:
        """A worker attached: keep the adapters that fit its model (a misfit is logged and dropped)."""
        if not self.config.enable_lora:
            return
        if shapes is None:
            raise InvalidRequestError("this scheduler runs with --enable-lora but the worker does not; start "
                                      "the worker with --enable-lora too", param="enable_lora")
        self.shapes = shapes
        for name, path in list(self.adapters.items()):
            try:
                read_adapter(path, shapes, self.config.max_lora_rank)
            except LoraAdapterError as exc:
                log.error("LoRA adapter %s is not served: %s", name, exc)
                self.unload(name)

    def load(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter; InvalidRequestError / NotFoundError (vLLM's words) when it cannot be."""
        if not self.config.enable_lora:
            raise InvalidRequestError("LoRA is not enabled; start the server with --enable-lora", param="lora_name")
        if not name or not path:
            raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if name in self.adapters:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            read_adapter(path, self.shapes, self.config.max_lora_rank)
        except LoraAdapterError as exc:
            err = NotFoundError if exc.not_found else InvalidRequestError
            raise err(f"Failed to load LoRA adapter '{name}': {exc}", param="lora_path",
                      code="lora_adapter_not_found" if exc.not_found else "invalid_lora_adapter") from None
        self.adapters[name] = path
        for unloaded in (self.unloaded, *self._also_unloaded):
            unloaded.discard(name)
        log.info("LoRA adapter %s registered from %s", name, path)

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                                code="lora_adapter_not_found")
        del self.adapters[name]
        for unloaded in (self.unloaded, *self._also_unloaded):
            unloaded.add(name)
        log.info("LoRA adapter %s unloaded", name)

    def resolve(self, name: str) -> str:
        """The folder of the adapter a request names (its `model`), or NotFoundError in OpenAI's words."""
        path = self.adapters.get(name)
        if path is None:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return path
