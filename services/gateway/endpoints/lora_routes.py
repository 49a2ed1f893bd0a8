"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM answers them (registered only with
--allow-runtime-lora-updating; otherwise they are 404 like any unknown route). The engine checks the adapter
(folder, config, rank, targets, fit to the base model) and says what is wrong; every replica registers it."""

from __future__ import annotations

from aiohttp import web

from steploop.gateway.app_keys import SERVING
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v
from steploop.gateway.http_io.request_body import read_json


async def load_lora_adapter(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    body = await read_json(request)
    name, path = v.get_str(body, "lora_name"), v.get_str(body, "lora_path")
    if not name or not path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    if name == serving.model.served_model_name:
        raise bad_request(f"'{name}' is the base model's name; give the adapter another one", param="lora_name")
    await serving.engine.load_lora_adapter(name, path)
    serving.model.lora_adapters[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    body = await read_json(request)
    name = v.get_str(body, "lora_name")
    if not name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
    await serving.engine.unload_lora_adapter(name)
    serving.model.lora_adapters.pop(name, None)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_routes(app: web.Application) -> None:
    if app[SERVING].lora.allow_runtime_lora_updating:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
