"""The gateway maps OpenAI's max_tokens onto the engine's and leaves the context check to the engine: chat unset
stays unset (what fits), completions default to 16, echo with 0 asks for one token and drops it; values the wire
cannot carry are a 400, never a 500; an engine refusal about the prompt names chat's `messages`."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import SERVED_NAME
from tests.gateway.test_gateway_errors import CHAT, assert_error, post


async def test_defaults_as_the_engine_gets_them(gateway):
    assert (await post(gateway, "/v1/chat/completions", CHAT))[0] == 200
    assert (await post(gateway, "/v1/completions", {"model": SERVED_NAME, "prompt": "hi"}))[0] == 200
    status, body, _ = await post(gateway, "/v1/completions", {"model": SERVED_NAME, "prompt": [5, 6], "echo": True,
                                                                "max_tokens": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 0
    chat, completion, echo = (r.sampling for r in gateway.engine.requests)
    assert not chat.HasField("max_tokens")                        # unset: the engine gives it what fits
    assert completion.max_tokens == 16 and echo.max_tokens == 1   # OpenAI's completions default; echo's one token


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2**32}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**30}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 2**40}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**31}, "top_k"),
    ("/v1/responses", {"model": SERVED_NAME, "input": "hi", "top_k": 2**31}, "top_k"),
    ("/v1/responses", {"model": SERVED_NAME, "input": "hi", "max_output_tokens": 2**63}, "max_output_tokens"),
    ("/v1/messages", {**CHAT, "max_tokens": 2**32}, "max_tokens"),
    ("/v1/messages", {**CHAT, "max_tokens": 4, "top_k": 2**31}, "top_k"),
])
async def test_values_the_wire_cannot_carry_are_400(gateway, path, body, param):
    status, resp, _ = await post(gateway, path, body)
    assert status == 400, resp
    if path == "/v1/messages":       # Anthropic's error shape: the field is named in the message
        assert resp["type"] == "error" and param in resp["error"]["message"]
    else:
        assert_error(resp, param=param)
    assert gateway.engine.requests == []


async def test_engine_refusals_name_the_chat_messages(gateway):
    gateway.engine.max_model_len = 8                              # the chat template alone is longer
    status, resp, _ = await post(gateway, "/v1/chat/completions", CHAT)
    assert status == 400
    assert_error(resp, param="messages", code="context_length_exceeded")
    assert "maximum context length is 8 tokens" in resp["error"]["message"]
