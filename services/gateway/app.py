"""create_app: the aiohttp application, wired from a config, an engine client and a tokenizer (tests pass fakes).

Middlewares, outermost first: errors (every failure leaves as OpenAI's error shape, never a traceback), drain
(503 once shutting down; counts requests in flight), auth (Bearer key on /v1 routes, constant-time compare),
admin auth (the admin key on the engine control routes, admin_auth.py), then the handlers in routes.py.
"""

from __future__ import annotations

import hmac
import logging
import pathlib

from aiohttp import web

from steploop.common import model_path
from steploop.gateway import cors
from steploop.gateway import metrics as gateway_metrics
from steploop.gateway import request_class
from steploop.gateway.admin_auth import admin_middleware
from steploop.gateway.app_keys import (
    BATCHES,
    CHAT_TEMPLATE,
    DRAIN,
    HEALTH,
    IMAGE_PROMPTS,
    MAX_BODY,
    PAUSE_GATE,
    REASONING_PARSER,
    RESPONSE_STORE,
    SERVING,
    TOOL_PARSER,
)
from steploop.gateway.batch_api.service import BatchService
from steploop.gateway.config import GatewayConfig
from steploop.gateway.drain import Drain
from steploop.gateway.endpoints import control_routes, routes
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError, internal_error
from steploop.gateway.health import HealthProbe
from steploop.gateway.messages_api import errors as anthropic_errors
from steploop.gateway.model_state import ModelState
from steploop.gateway.pause_gate import PauseGate
from steploop.gateway.responses_api.store import ResponseStore
from steploop.gateway.routing import route_header
from steploop.gateway.serving import Serving
from steploop.gateway.text.chat_template import ChatTemplate
from steploop.gateway.text.image_prompt_loader import load_image_prompts
from steploop.gateway.text.reasoning import get_reasoning_parser
from steploop.gateway.text.tokenizer import Tokenizer
from steploop.gateway.tool_parsers import get_tool_parser

logger = logging.getLogger(__name__)

# aiohttp's own HTTP errors (unknown route, wrong method, body too large) as OpenAI error codes.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return _render(request, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _render(request, _http_error(request, exc))
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _render(request, internal_error())


def _render(request: web.Request, err: APIError) -> web.Response:
    """In the shape of the API the path belongs to: Anthropic's for /v1/messages*, OpenAI's elsewhere."""
    if request.path.startswith(anthropic_errors.PATH_PREFIX):
        return anthropic_errors.to_response(err)
    return err.to_response()


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    """aiohttp's own errors in words a client can act on: which routes exist, which methods a route takes."""
    headers: dict[str, str] = {}
    if exc.status == 413:
        message = f"request body too large: the limit is {request.app[MAX_BODY]} bytes"
    elif exc.status == 404 and request.match_info.http_exception is not None:    # no route matched
        message = (f"Invalid URL ({request.method} {request.path}): no such route. This server answers: "
                   f"{', '.join(routes.route_list(request.app))}")
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = sorted(exc.allowed_methods - {"HEAD"})
        message = f"{request.method} is not allowed on {request.path}; use {' or '.join(allowed)}"
        headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
    else:
        message = exc.text or exc.reason
    return APIError(exc.status, message, code=_HTTP_CODES.get(exc.status), headers=headers)


def auth_middleware(api_key: str):
    """`Authorization: Bearer <key>` (OpenAI's SDK) or `x-api-key: <key>` (Anthropic's)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            bearer = request.headers.get("Authorization", "").encode()
            key = f"Bearer {request.headers.get('x-api-key', '')}".encode()
            if not (hmac.compare_digest(bearer, expected) | hmac.compare_digest(key, expected)):
                raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                               "'x-api-key: <key>'", code="invalid_api_key")
        return await handler(request)

    return check_key


def create_app(config: GatewayConfig, engine_client: EngineClient, tokenizer: Tokenizer) -> web.Application:
    """The gateway app. On startup it asks the engine for model info (not fatal if the engine is not up yet)."""
    drain = Drain()
    middlewares = [error_middleware, drain.middleware, route_header.middleware,   # route: x-steploop-replica
                   request_class.middleware]                                      # Batch API lines: background
    if config.api_key:
        middlewares.append(auth_middleware(config.api_key))
    if config.admin_api_key:
        middlewares.append(admin_middleware(config.admin_api_key, config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_request_body_bytes)
    app.middlewares.insert(0, cors.install(app, config.cors))   # outermost: a preflight carries no API key
    app.on_response_prepare.append(route_header.on_prepare)
    path = model_path.model_dir_for(config.model)
    name = config.served_model_name or model_path.served_model_name(config.model, path)
    model = ModelState(engine_client, name, str(path))
    reasoning = get_reasoning_parser(config.reasoning_parser)
    app[PAUSE_GATE] = gate = PauseGate(config.paused_request_timeout)
    app[SERVING] = Serving(engine_client, tokenizer, model, config.lora, gate,
                           keep_special_tokens=reasoning is not None and reasoning.needs_special_tokens)
    app[TOOL_PARSER] = tool_parser = get_tool_parser(config.tool_call_parser)
    app[CHAT_TEMPLATE] = ChatTemplate(tokenizer, tool_parser)
    app[IMAGE_PROMPTS] = load_image_prompts(path, name, config.media)
    app[HEALTH] = HealthProbe(engine_client, drain)
    app[DRAIN] = drain
    app[MAX_BODY] = config.max_request_body_bytes
    app[RESPONSE_STORE] = ResponseStore()
    app[REASONING_PARSER] = reasoning
    app[BATCHES] = batches = BatchService(
        pathlib.Path(config.batch_dir) if config.batch_dir else model_path.cache_dir() / "batches",
        max_file_bytes=config.batch_max_file_bytes, max_lines=config.batch_max_lines,
        max_jobs=config.batch_max_jobs, concurrency=config.batch_concurrency, api_key=config.api_key)
    routes.add_routes(app)
    control_routes.add_routes(app, enabled=bool(config.admin_api_key))   # the admin routes, only with a key
    gateway_metrics.install(app, engine_client, model)   # /metrics, HTTP metrics, the request's span

    async def fetch_model_info(_: web.Application) -> None:
        await model.try_refresh()
        try:      # started while the engine is paused (a gateway restart): new requests wait from the start
            if (await engine_client.control_state()).paused:
                gate.close()
        except APIError as err:
            logger.debug("engine control state not available (%s)", err.message)

    async def open_batches(_: web.Application) -> None:
        batches.open()       # the runner starts once the site listens (server.start_batches)

    async def close_batches(_: web.Application) -> None:
        await batches.close()

    app.on_startup.append(fetch_model_info)
    app.on_startup.append(open_batches)
    app.on_cleanup.append(close_batches)
    return app
