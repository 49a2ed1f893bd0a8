"""The Responses handlers: parse, prepend the stored conversation of previous_response_id, render with the chat
template (as chat completions do, so the same conversation is the same prompt), run through Serving, shape, and
store the response (`store` defaults to true, as OpenAI's)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from steploop.gateway.app_keys import (
    CHAT_TEMPLATE,
    IMAGE_PROMPTS,
    REASONING_PARSER,
    RESPONSE_STORE,
    SERVING,
    TOOL_PARSER,
)
from steploop.gateway.errors import APIError
from steploop.gateway.http_io.request_body import read_json
from steploop.gateway.http_io.sse import stream_typed_sse
from steploop.gateway.responses_api import outputs
from steploop.gateway.responses_api.protocol import parse_input, parse_responses
from steploop.gateway.responses_api.store import ResponseStore
from steploop.gateway.text.image_prompts import images_of
from steploop.gateway.text.reasoning import split_reasoning


def error_event(err: APIError) -> dict[str, Any]:
    """A stream that failed after its 200: Responses' `error` event."""
    return {"type": "error", "code": err.code, "message": err.message, "param": err.param}


def _remember(store: ResponseStore, conversation: tuple[dict[str, Any], ...], response: dict[str, Any]) -> None:
    """The conversation a later previous_response_id continues: this input, then this response's output."""
    said = [item for item in response["output"] if item["type"] in ("message", "function_call")]
    store.put(response, conversation + tuple(parse_input(said)) if said else conversation)


async def create(request: web.Request) -> web.StreamResponse:
    serving, store = request.app[SERVING], request.app[RESPONSE_STORE]
    req = parse_responses(await read_json(request), request.app[TOOL_PARSER],
                         await serving.model.sampling_defaults())
    lora_name = serving.check_model(req.model)
    history = store.get(req.previous_response_id, "previous_response_id").messages if req.previous_response_id else ()
    conversation = history + req.items
    system = ({"role": "system", "content": req.instructions},) if req.instructions is not None else ()
    image_prompts = request.app[IMAGE_PROMPTS]
    images = await image_prompts.prepare(images_of(conversation))   # a stored turn's images load again (by ref)
    prompt = await request.app[CHAT_TEMPLATE].render(system + conversation, add_generation_prompt=True,
                                                     continue_final_message=False, tools=req.tools)
    features = []
    if images:
        prompt, features = await image_prompts.expand(prompt, images, param="input")
    meta = outputs.ResponseMeta(outputs.item_id("resp"), serving.model.served_model_name, req.echo,
                                req.previous_response_id, req.store)
    choices = await serving.make_choices(meta.id, [prompt], req.sampling, "input", lora_name=lora_name,
                                         mm_features=features)
    events = split_reasoning(serving.run(choices), request.app[REASONING_PARSER])

    def on_done(response: dict[str, Any]) -> None:
        if req.store:
            _remember(store, conversation, response)
        else:
            store.not_stored(response["id"])

    if req.sampling.stream:
        return await stream_typed_sse(request, outputs.response_events(meta, events, req.tools, on_done), error_event)
    body = await outputs.response_body(meta, events, req.tools)
    on_done(body)
    return web.json_response(body)


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(request.app[RESPONSE_STORE].get(request.match_info["response_id"]).response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    request.app[RESPONSE_STORE].delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
