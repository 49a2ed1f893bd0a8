"""HTTP handlers: parse, delegate to Serving, answer. Errors are raised as APIError and rendered in app.py."""

from __future__ import annotations

import json
import time
from importlib import metadata
from typing import Any

import jinja2
from aiohttp import web

from services.gateway import outputs, utility_routes
from services.gateway.errors import bad_request
from services.gateway.health import HealthProbe
from services.gateway.protocol import parse_chat, parse_completion
from services.gateway.responses import Meta, new_id
from services.gateway.serving import Serving
from services.gateway.sse import stream_sse

SERVING = web.AppKey("serving", Serving)
HEALTH = web.AppKey("health", HealthProbe)
STARTED_AT = int(time.time())


def _version() -> str:
    try:
        return metadata.version("steploop")
    except metadata.PackageNotFoundError:
        return "0.0.0+dev"


async def read_json(request: web.Request) -> Any:
    raw = await request.read()   # over the app's client_max_size: HTTPRequestEntityTooLarge, a 413 in app.py
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if b"\\ud" in raw or b"\\uD" in raw:   # only a \uD800-\uDFFF escape can put a lone surrogate in a str
        _refuse_lone_surrogates(body, "")
    return body


def _refuse_lone_surrogates(value: Any, path: str) -> None:
    """JSON may escape half of a UTF-16 pair ("\\ud83d" alone); Python keeps it, the tokenizer cannot encode it."""
    if isinstance(value, str):
        if any("\ud800" <= ch <= "\udfff" for ch in value):
            top = path.split(".")[0].split("[")[0] or None
            raise bad_request(f"'{path}' contains a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape); "
                              "text must be valid Unicode", param=top, code="invalid_unicode")
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_lone_surrogates(item, f"{path}[{i}]")


async def completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    req = parse_completion(await read_json(request), serving.model.vocab_size or None)
    serving.check_model(req.model)
    prompts = [p if isinstance(p, tuple) else await serving.tokenizer.encode(p) for p in req.prompts]
    texts = [p if isinstance(p, str) else None for p in req.prompts]
    meta = Meta(new_id("cmpl"), serving.model.served_model_name)
    choices = await serving.make_choices(meta.id, prompts, req.sampling, "prompt", texts)
    events = serving.run(choices)
    logprobs = req.sampling.logprobs >= 0
    if req.sampling.stream:
        return await stream_sse(request, outputs.completion_chunks(meta, events, req.sampling.n,
                                                                   req.sampling.include_usage, logprobs))
    return web.json_response(await outputs.completion_body(meta, events, req.sampling.n, logprobs))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    req = parse_chat(await read_json(request), serving.model.vocab_size or None)
    serving.check_model(req.model)
    try:
        prompt = await serving.tokenizer.apply_chat_template(
            list(req.messages), add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tools=req.tools)
    except (ValueError, jinja2.TemplateError) as err:   # no template, or the template refused the conversation (raise_exception)
        raise bad_request(f"cannot apply the chat template: {err}", param="messages") from None
    meta = Meta(new_id("chatcmpl"), serving.model.served_model_name)
    choices = await serving.make_choices(meta.id, [prompt], req.sampling, "messages")
    events = serving.run(choices)
    logprobs = req.sampling.logprobs >= 0
    if req.sampling.stream:
        indices = [c.index for c in choices]
        return await stream_sse(request, outputs.chat_chunks(meta, events, indices, req.sampling.n,
                                                             req.sampling.include_usage, logprobs, req.tools))
    return web.json_response(await outputs.chat_body(meta, events, req.sampling.n, logprobs, req.tools))


async def _model_card(serving: Serving) -> dict[str, Any]:
    model = serving.model
    if model.max_model_len == 0:
        await model.try_refresh()
    return {"id": model.served_model_name, "object": "model", "created": STARTED_AT, "owned_by": "steploop",
            "root": model.model_path, "parent": None, "max_model_len": model.max_model_len or None}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [await _model_card(request.app[SERVING])]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the SDK's models.retrieve): the card, or 404 model_not_found."""
    serving = request.app[SERVING]
    serving.check_model(request.match_info["model_id"])
    return web.json_response(await _model_card(serving))


async def health(request: web.Request) -> web.Response:
    ready = await request.app[HEALTH].ready()
    return web.Response(status=200 if ready else 503, text="ok" if ready else "not ready")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": _version()})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)   # served names may hold "/" (a folder path)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    utility_routes.add_routes(app)
