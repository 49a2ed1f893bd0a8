"""vLLM's utility endpoints beside the OpenAI ones: /tokenize, /detokenize, and /openapi.json (registered with
the others in routes.add_routes).

    POST /tokenize    {"prompt": str, "add_special_tokens": bool}            -> {"count", "max_model_len", "tokens"}
                      {"messages": [...], "add_generation_prompt": bool, ...}   (the chat template applied)
    POST /detokenize  {"tokens": [int]}                                       -> {"prompt": str}
    GET  /openapi.json                                                        -> the REST API (openapi.py)
"""

from __future__ import annotations

from aiohttp import web

from steploop.gateway.app_keys import BATCHES, CHAT_TEMPLATE, SERVING, TOOL_PARSER
from steploop.gateway.endpoints.openapi import openapi_spec
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v
from steploop.gateway.http_io.request_body import read_json
from steploop.gateway.openai_api.protocol import parse_chat_messages, parse_template_kwargs
from steploop.gateway.tool_parsers.tools import parse_tools


async def tokenize(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    body = v.require_object(await read_json(request))
    serving.check_model(v.get_str(body, "model"))
    if body.get("messages") is not None:
        messages, add_generation_prompt, continue_final = parse_chat_messages(body)
        tools = parse_tools(body, "", request.app[TOOL_PARSER])   # counted as the chat request renders them
        tokens = await request.app[CHAT_TEMPLATE].render(messages, add_generation_prompt=add_generation_prompt,
                                                         continue_final_message=continue_final, tools=tools,
                                                         template_kwargs=parse_template_kwargs(body))
    else:
        prompt = v.get_str(body, "prompt")
        if prompt is None:
            raise bad_request("'prompt' or 'messages' is required", param="prompt", code="missing_required_parameter")
        tokens = await serving.tokenizer.encode(prompt, v.get_bool(body, "add_special_tokens", True))
    # vLLM's return_token_strs: each token as the vocabulary spells it (byte-level BPE shows a space as "Ġ")
    token_strs = serving.tokenizer.hf.convert_ids_to_tokens(tokens) if v.get_bool(body, "return_token_strs",
                                                                                  False) else None
    return web.json_response({"count": len(tokens), "max_model_len": await serving.model.known_max_model_len(),
                              "tokens": tokens, "token_strs": token_strs})


async def detokenize(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    body = v.require_object(await read_json(request))
    serving.check_model(v.get_str(body, "model"))
    if body.get("tokens") is None:
        raise bad_request("'tokens' is required", param="tokens", code="missing_required_parameter")
    tokens = v.get_token_ids(body.get("tokens"), "tokens", serving.tokenizer.vocab_size)
    return web.json_response({"prompt": serving.tokenizer.decode(tokens, skip_special_tokens=False)})


async def openapi(request: web.Request) -> web.Response:
    """The routes this gateway serves: the Batch API when it runs, the control routes when they are registered."""
    app = request.app
    control = any(r.canonical == "/pause" for r in app.router.resources())
    return web.json_response(openapi_spec(str(request.url.origin()), batch=app[BATCHES].runner is not None,
                                          control=control))

