"""The gateway app's shared objects, one typed key each: set in app.create_app, read by handlers and the server.
This module imports only the types it names, so any module may import it without a cycle."""

from __future__ import annotations

from aiohttp import web

from steploop.gateway.batch_api.service import BatchService
from steploop.gateway.drain import Drain
from steploop.gateway.health import HealthProbe
from steploop.gateway.pause_gate import PauseGate
from steploop.gateway.responses_api.store import ResponseStore
from steploop.gateway.serving import Serving
from steploop.gateway.text.chat_template import ChatTemplate
from steploop.gateway.text.image_prompts import ImagePrompts
from steploop.gateway.text.reasoning import ReasoningParser
from steploop.gateway.tool_parsers import ToolParser

SERVING = web.AppKey("serving", Serving)                  # the request flow both OpenAI endpoints share
CHAT_TEMPLATE = web.AppKey("chat_template", ChatTemplate)  # chat requests (and /tokenize) -> prompt token ids
TOOL_PARSER = web.AppKey("tool_parser", ToolParser)       # --tool-call-parser: the format of "auto" tool calls
HEALTH = web.AppKey("health", HealthProbe)
DRAIN = web.AppKey("drain", Drain)
MAX_BODY = web.AppKey("max_body", int)                   # --max-request-body-bytes, for the 413's message
RESPONSE_STORE = web.AppKey("response_store", ResponseStore)   # /v1/responses kept (store defaults to true)
REASONING_PARSER = web.AppKey("reasoning_parser", ReasoningParser)   # --reasoning-parser; None: no split
PAUSE_GATE = web.AppKey("pause_gate", PauseGate)          # POST /pause holds new generation requests here
BATCHES = web.AppKey("batches", BatchService)           # the Batch API's stores and runner (batch_api/)
IMAGE_PROMPTS = web.AppKey("image_prompts", ImagePrompts)   # images of chat requests -> pixels, expanded prompt
