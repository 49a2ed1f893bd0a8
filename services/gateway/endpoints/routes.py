"""The OpenAI routes' handlers (parse, delegate to Serving, answer) and `add_routes`, the one place every route of
the app is registered (vLLM's utility routes' handlers are in utility_routes.py). Errors are raised as APIError
and rendered in app.py."""

from __future__ import annotations

import time
from importlib import metadata
from typing import Any

from aiohttp import web

from steploop.gateway.app_keys import CHAT_TEMPLATE, HEALTH, IMAGE_PROMPTS, REASONING_PARSER, SERVING, TOOL_PARSER
from steploop.gateway.batch_api import routes as batch_routes
from steploop.gateway.embeddings_api import routes as embeddings_routes
from steploop.gateway.endpoints import lora_routes, utility_routes
from steploop.gateway.http_io.request_body import read_json
from steploop.gateway.http_io.sse import stream_sse
from steploop.gateway.messages_api import routes as messages_routes
from steploop.gateway.openai_api import outputs
from steploop.gateway.openai_api.protocol import parse_chat, parse_completion
from steploop.gateway.openai_api.responses import Meta, new_id
from steploop.gateway.openai_api.structured_length import log_length_finishes, structured_kind
from steploop.gateway.responses_api import routes as responses_routes
from steploop.gateway.serving import Serving, model_not_found
from steploop.gateway.text.image_prompts import images_of
from steploop.gateway.text.reasoning import split_reasoning

STARTED_AT = int(time.time())


def _version() -> str:
    try:
        return metadata.version("steploop")
    except metadata.PackageNotFoundError:
        return "0.0.0+dev"


async def completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    req = parse_completion(await read_json(request), serving.model.vocab_size or None,
                           await serving.model.sampling_defaults())
    lora_name = serving.check_model(req.model)
    prompts = [p if isinstance(p, tuple) else await serving.tokenizer.encode(p) for p in req.prompts]
    texts = [p if isinstance(p, str) else None for p in req.prompts]
    meta = Meta(new_id("cmpl"), lora_name or serving.model.served_model_name)
    choices = await serving.make_choices(meta.id, prompts, req.sampling, "prompt", texts, lora_name=lora_name)
    events = log_length_finishes(serving.run(choices), meta.id, structured_kind(req.sampling))
    logprobs = req.sampling.logprobs >= 0
    if req.sampling.stream:
        return await stream_sse(request, outputs.completion_chunks(meta, events, req.sampling.n,
                                                                   req.sampling.include_usage, logprobs))
    return web.json_response(await outputs.completion_body(meta, events, req.sampling.n, logprobs))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    req = parse_chat(await read_json(request), serving.model.vocab_size or None, request.app[TOOL_PARSER],
                     await serving.model.sampling_defaults())
    lora_name = serving.check_model(req.model)
    image_prompts = request.app[IMAGE_PROMPTS]
    images = await image_prompts.prepare(images_of(req.messages))     # a 400 for a text-only model or bad image
    prompt = await request.app[CHAT_TEMPLATE].render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                                     continue_final_message=req.continue_final_message,
                                                     tools=req.tools, template_kwargs=req.template_kwargs)
    features = []
    if images:
        prompt, features = await image_prompts.expand(prompt, images)
    meta = Meta(new_id("chatcmpl"), lora_name or serving.model.served_model_name)
    choices = await serving.make_choices(meta.id, [prompt], req.sampling, "messages", lora_name=lora_name,
                                         mm_features=features)
    events = log_length_finishes(serving.run(choices), meta.id, structured_kind(req.sampling, req.tools))
    events = split_reasoning(events, request.app[REASONING_PARSER])
    logprobs = req.sampling.logprobs >= 0
    if req.sampling.stream:
        indices = [c.index for c in choices]
        return await stream_sse(request, outputs.chat_chunks(meta, events, indices, req.sampling.n,
                                                             req.sampling.include_usage, logprobs, req.tools,
                                                             req.echo))
    return web.json_response(await outputs.chat_body(meta, events, req.sampling.n, logprobs, req.tools, req.echo))


async def _model_cards(serving: Serving) -> list[dict[str, Any]]:
    """The base model's card, then one per LoRA adapter (vLLM's: root = the adapter's folder, parent = the base)."""
    model = serving.model
    await model.refresh_adapters()
    max_len = await model.known_max_model_len()
    card = {"id": model.served_model_name, "object": "model", "created": STARTED_AT, "owned_by": "steploop",
            "root": model.model_path, "parent": None, "max_model_len": max_len,
            "tasks": model.tasks()}   # ["generate"] or ["embed"] (vLLM's task names); [] while no worker is up
    return [card] + [{**card, "id": name, "root": path, "parent": model.served_model_name}
                     for name, path in model.lora_adapters.items()]


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": await _model_cards(request.app[SERVING])})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the SDK's models.retrieve): the card, or 404 model_not_found."""
    model_id = request.match_info["model_id"]
    for card in await _model_cards(request.app[SERVING]):
        if card["id"] == model_id:
            return web.json_response(card)
    raise model_not_found(model_id)


async def health(request: web.Request) -> web.Response:
    ready = await request.app[HEALTH].ready()
    return web.Response(status=200 if ready else 503, text="ok" if ready else "not ready")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": _version()})


def add_routes(app: web.Application) -> None:
    """Every route the gateway answers (/metrics is metrics.py's, added by its install)."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)   # served names may hold "/" (a folder path)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", utility_routes.tokenize)
    app.router.add_post("/detokenize", utility_routes.detokenize)
    app.router.add_get("/openapi.json", utility_routes.openapi)
    messages_routes.add_routes(app)   # Anthropic's Messages API
    responses_routes.add_routes(app)  # OpenAI's Responses API
    embeddings_routes.add_routes(app)  # OpenAI's Embeddings API (a --runner pooling worker)
    lora_routes.add_routes(app)       # /v1/load_lora_adapter, /v1/unload_lora_adapter (when allowed)
    batch_routes.add_routes(app)      # OpenAI's Batch API: /v1/files, /v1/batches


def route_list(app: web.Application) -> list[str]:
    """"METHOD /path" of every route, in the order they were added (aiohttp's automatic HEADs left out)."""
    seen: dict[str, None] = {}
    for route in app.router.routes():
        if route.method != "HEAD" and route.resource is not None:
            seen[f"{route.method} {route.resource.canonical}"] = None
    return list(seen)
