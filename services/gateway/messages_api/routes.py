"""The Messages handlers: parse Anthropic's body, render the conversation with the chat template (as chat
completions do, so the same conversation is the same prompt), run it through Serving, shape the reply. Errors
raised here are APIErrors; app.py renders those of /v1/messages* with errors.to_response."""

from __future__ import annotations

import uuid

from aiohttp import web

from steploop.gateway.app_keys import CHAT_TEMPLATE, IMAGE_PROMPTS, REASONING_PARSER, SERVING, TOOL_PARSER
from steploop.gateway.http_io import validation as v
from steploop.gateway.http_io.request_body import read_json
from steploop.gateway.http_io.sse import stream_typed_sse
from steploop.gateway.messages_api import errors, outputs
from steploop.gateway.messages_api.protocol import parse_conversation, parse_messages, parse_tool_request
from steploop.gateway.openai_api.responses import Meta
from steploop.gateway.text.image_prompts import images_of
from steploop.gateway.text.reasoning import split_reasoning


async def messages(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    req = parse_messages(await read_json(request), request.app[TOOL_PARSER],
                        await serving.model.sampling_defaults())
    lora_name = serving.check_model(req.model)
    image_prompts = request.app[IMAGE_PROMPTS]
    images = await image_prompts.prepare(images_of(req.messages))     # a 400 for a text-only model or bad image
    prompt = await request.app[CHAT_TEMPLATE].render(req.messages, add_generation_prompt=not req.continue_final_message,
                                                     continue_final_message=req.continue_final_message,
                                                     tools=req.tools)
    features = []
    if images:
        prompt, features = await image_prompts.expand(prompt, images)
    meta = Meta(f"msg_{uuid.uuid4().hex}", serving.model.served_model_name)
    choices = await serving.make_choices(meta.id, [prompt], req.sampling, "messages", api="Messages",
                                         lora_name=lora_name, mm_features=features)
    events = split_reasoning(serving.run(choices), request.app[REASONING_PARSER])
    if req.sampling.stream:
        return await stream_typed_sse(request, outputs.message_events(meta, events, req.tools, len(prompt)),
                                      errors.error_event)
    return web.json_response(await outputs.message_body(meta, events, req.tools))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt a Messages request with this body would have, counted (tools included, as they are rendered)."""
    serving = request.app[SERVING]
    body = v.require_object(await read_json(request))
    serving.check_model(v.get_str(body, "model"))
    messages, prefill = parse_conversation(body)
    tools = parse_tool_request(body, request.app[TOOL_PARSER])
    image_prompts = request.app[IMAGE_PROMPTS]
    images = await image_prompts.prepare(images_of(messages), served=False)   # images count as the tokens they expand to
    prompt = await request.app[CHAT_TEMPLATE].render(messages, add_generation_prompt=not prefill,
                                                     continue_final_message=prefill, tools=tools)
    if images:
        prompt, _ = await image_prompts.expand(prompt, images)
    return web.json_response({"input_tokens": len(prompt)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
