"""Error answers keep OpenAI's shape {"error": {message, type, param, code}}; raw HTTP, no SDK."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import grpc
import openai
import pytest

from steploop.gateway import errors
from steploop.gateway.app import create_app
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.server import bound_port, start_site
from tests.gateway.conftest import SERVED_NAME, Gateway, sent_prompt, serving_app, wait_for
from tests.gateway.fake_engine import start_fake_engine

CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]}


async def post(gateway, path, body, headers=None, raw=None):
    data = raw if raw is not None else json.dumps(body)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}{path}", data=data, headers={"Content-Type": "application/json",
                                                                       **(headers or {})}) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text.startswith("{") else text, resp.headers


def assert_error(body, param=None, code=None):
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stop": [1, 2]}, "stop"),
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "logprobs": "yes"}, "logprobs"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({**CHAT, "response_format": {"type": "yaml"}}, "response_format"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({**CHAT, "top_k": -2}, "top_k"),
    ({**CHAT, "min_p": 1.5}, "min_p"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": -3}, "frequency_penalty"),
    ({**CHAT, "min_tokens": -1}, "min_tokens"),
    ({**CHAT, "min_tokens": 10, "max_tokens": 3}, "min_tokens"),
    ({**CHAT, "ignore_eos": 1}, "ignore_eos"),
    ({**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({**CHAT, "n": 100}, "n"),
    ({**CHAT, "messages": []}, "messages"),
    ({"model": SERVED_NAME}, "messages"),
    ({**CHAT, "temperature": -1}, "temperature"),
    ({**CHAT, "max_tokens": -3}, "max_tokens"),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    # audio output was ignored and a text-only reply sent instead
    ({**CHAT, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({**CHAT, "modalities": "text"}, "modalities"),
    ({**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
async def test_chat_bad_parameters(gateway, body, param):
    status, resp, _ = await post(gateway, "/v1/chat/completions", body)
    assert status == 400
    assert_error(resp, param=param)
    assert resp["error"]["type"] == "invalid_request_error"
    assert gateway.engine.requests == []


async def test_assistant_refusal_parts_reach_the_template_as_text(gateway, tokenizer):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I will not say that."}]},
                {"role": "user", "content": "ok"}]
    status, resp, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert status == 200, resp   # was a 400 claiming "images and audio are not supported"
    assert "I will not say that." in sent_prompt(gateway, tokenizer)


@pytest.mark.parametrize("part, says", [
    ({"type": "text", "text": 5}, "its 'text' is not a string"),
    ({"type": "refusal", "refusal": "no"}, "got type 'refusal'"),     # only an assistant turn may refuse
    ({"type": "input_audio"}, "got type 'input_audio'"),
    ("plain", "got string"),
])
async def test_a_bad_content_part_is_named_for_what_it_is(gateway, part, says):
    status, resp, _ = await post(gateway, "/v1/chat/completions",
                                 {**CHAT, "messages": [{"role": "system", "content": [part]}]})
    assert status == 400 and says in resp["error"]["message"], resp


async def test_text_only_modalities_are_accepted(gateway):
    for extra in ({"modalities": ["text"]}, {"modalities": None, "audio": None}):
        assert (await post(gateway, "/v1/chat/completions", {**CHAT, **extra}))[0] == 200


@pytest.mark.parametrize("body, param", [
    ({"model": SERVED_NAME}, "prompt"),
    ({"model": SERVED_NAME, "prompt": 5}, "prompt"),
    ({"model": SERVED_NAME, "prompt": [1, "a"]}, "prompt"),
    ({"model": SERVED_NAME, "prompt": [1, 10**9]}, "prompt"),
    ({"model": SERVED_NAME, "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": SERVED_NAME, "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": SERVED_NAME, "prompt": "x", "logprobs": -1}, "logprobs"),
    ({"model": SERVED_NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": SERVED_NAME, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": SERVED_NAME, "prompt": ""}, "prompt"),
])
async def test_completion_bad_parameters(gateway, body, param):
    status, resp, _ = await post(gateway, "/v1/completions", body)
    assert status == 400
    assert_error(resp, param=param)


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "\"text\"", "\xff\xfe"])
async def test_malformed_or_non_object_body(gateway, raw):
    status, resp, _ = await post(gateway, "/v1/chat/completions", None, raw=raw.encode("latin-1"))
    assert status == 400
    assert_error(resp)


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "a \\ud83d b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\uDE00"}]}', "messages"),
    ("/tokenize", b'{"prompt": "x\\udbff"}', "prompt")])
async def test_lone_surrogate_is_400_not_a_tokenizer_crash(gateway, path, raw, param):
    status, resp, _ = await post(gateway, path, None, raw=raw)
    assert status == 400, resp
    assert_error(resp, param=param, code="invalid_unicode")


async def test_escaped_surrogate_pair_is_one_character(gateway, tokenizer):
    """A whole pair ("\\ud83d\\ude00", as some clients escape emoji) is valid JSON text: one emoji."""
    status, resp, _ = await post(gateway, "/tokenize", None, raw=b'{"prompt": "\\ud83d\\ude00", '
                                                                 b'"add_special_tokens": false}')
    assert status == 200 and resp["tokens"] == tokenizer.encode_sync("\U0001F600", add_special_tokens=False)


async def test_unknown_model_is_404(gateway):
    status, resp, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "model": "gpt-9"})
    assert status == 404
    assert_error(resp, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        await gateway.openai().chat.completions.create(model="gpt-9", messages=CHAT["messages"])


async def test_context_length_exceeded_names_both_numbers(gateway):
    status, resp, _ = await post(gateway, "/v1/completions", {"model": SERVED_NAME, "prompt": [7] * 2000,
                                                               "max_tokens": 100})
    assert status == 400
    assert_error(resp, code="context_length_exceeded", param="max_tokens")   # the prompt fits; max_tokens not
    assert "2048" in resp["error"]["message"] and "2100" in resp["error"]["message"]
    status, resp, _ = await post(gateway, "/v1/completions", {"model": SERVED_NAME, "prompt": [7] * 2048})
    assert status == 400 and resp["error"]["code"] == "context_length_exceeded"
    assert resp["error"]["param"] == "prompt"


def test_grpc_connection_failures_read_as_unavailable_not_as_grpc_internals():
    raw = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50161: Failed to connect to "
           "remote host: connect: Connection refused (111)")
    err = errors.from_status(grpc.StatusCode.UNAVAILABLE, raw, {})
    assert err.status == 503 and err.code == "engine_unavailable" and "ipv4" not in err.message
    own = errors.from_status(grpc.StatusCode.UNAVAILABLE, "no worker is attached",
                             {errors.ERROR_CODE_KEY: "service_unavailable"})
    assert "no worker is attached" in own.message     # the engine's own reasons (always with its code) are kept
    stopped = errors.from_status(grpc.StatusCode.UNAVAILABLE, "Cancelling all calls", {})   # a server's grace ended
    assert "Cancelling" not in stopped.message and "stopped before this request finished" in stopped.message
    odd = errors.from_status(grpc.StatusCode.UNAVAILABLE, "Stream removed", {})     # any other gRPC-internal text
    assert "Stream removed" not in odd.message and "not reachable" in odd.message


async def test_body_too_large_is_413(gateway):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    status, resp, _ = await post(gateway, "/v1/chat/completions", big)
    assert status == 413
    assert_error(resp, code="request_too_large")


async def test_unknown_route_is_openai_shaped_404_listing_the_routes(gateway):
    status, resp, _ = await post(gateway, "/v1/audio/speech", {})
    assert status == 404
    assert_error(resp, code="not_found")
    message = resp["error"]["message"]
    assert "POST /v1/audio/speech" in message   # what was asked
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model_id}",
                  "POST /tokenize", "POST /detokenize", "GET /openapi.json", "GET /health", "GET /version",
                  "GET /metrics"):
        assert route in message, route
    assert "POST /v1/embeddings" in message
    assert "HEAD " not in message


async def test_wrong_method_is_405_naming_the_allowed_one(gateway):
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.url}/v1/chat/completions") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
        body = await resp.json()
    assert_error(body, code="method_not_allowed")
    assert body["error"]["message"] == "GET is not allowed on /v1/chat/completions; use POST"


@pytest.mark.parametrize("session", [True, False])
async def test_engine_stopping_under_a_request_is_503_in_words(fake_engine, tokenizer, gateway_config, session):
    """The scheduler stops (its grace period over) while a request waits for its first token: the client gets a
    503 that says so, never gRPC's own "Cancelling all calls"."""
    fake_engine.token_delay_s = 5.0
    server, address, _ = await start_fake_engine(fake_engine)
    async with serving_app(EngineClient(address, multiplex=session), tokenizer, gateway_config) as (url, _):
        async with aiohttp.ClientSession() as http:
            pending = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}))
            await wait_for(lambda: fake_engine.requests)
            await server.stop(0.1)
            async with await pending as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                body = await resp.json()
    assert_error(body, code="engine_unavailable")
    assert "Cancelling" not in body["error"]["message"]
    assert "the engine stopped before this request finished" in body["error"]["message"]


@pytest.fixture
def gateway_config(gateway_config, request):
    key = getattr(request, "param", None)
    return replace(gateway_config, api_key=key) if key else gateway_config


@pytest.mark.parametrize("gateway_config", ["s3cret"], indirect=True)
async def test_api_key_required_on_v1_routes(gateway):
    status, resp, _ = await post(gateway, "/v1/chat/completions", CHAT)
    assert status == 401
    assert_error(resp, code="invalid_api_key")
    status, _, _ = await post(gateway, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer wrong"})
    assert status == 401
    r = await gateway.openai(api_key="s3cret").chat.completions.create(model=SERVED_NAME,
                                                                      messages=CHAT["messages"])
    assert r.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        await gateway.openai(api_key="nope").models.list()
    async with aiohttp.ClientSession() as http:   # probes need no key
        async with http.get(f"{gateway.url}/health") as resp:
            assert resp.status == 200


@pytest.mark.parametrize("status, meta, http_status, code", [
    (grpc.StatusCode.INVALID_ARGUMENT, ((errors.ERROR_CODE_KEY, "context_length_exceeded"),
                                        (errors.ERROR_PARAM_KEY, "max_tokens")), 400, "context_length_exceeded"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ((errors.RETRY_AFTER_KEY, "3"),), 503, "overloaded"),
    (grpc.StatusCode.UNAVAILABLE, (), 503, "engine_unavailable"),
    (grpc.StatusCode.INTERNAL, (), 500, "internal_error"),
])
async def test_engine_errors_map_to_http(gateway, status, meta, http_status, code):
    gateway.engine.status, gateway.engine.status_metadata = status, meta
    for stream in (False, True):
        got, resp, headers = await post(gateway, "/v1/chat/completions", {**CHAT, "stream": stream})
        assert got == http_status
        assert_error(resp, code=code)
        if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert headers["Retry-After"] == "3"
        if status == grpc.StatusCode.INVALID_ARGUMENT:
            assert resp["error"]["param"] == "max_tokens"
        assert "scripted failure" not in resp["error"]["message"] or http_status in (400, 429, 503)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
    ("/v1/completions", {"prompt": "a", "n": 5}, "n"),
    ("/v1/chat/completions", {"messages": CHAT["messages"], "n": 5}, "n"),
])
async def test_more_sequences_than_the_engine_ever_queues_is_a_400_not_a_503(fake_engine, tokenizer, gateway_config,
                                                                             path, body, param):
    """prompts x n above the engine's --max-waiting would be a 503 on every retry: a 400 naming the limit."""
    fake_engine.max_waiting = 4
    server, address, _ = await start_fake_engine(fake_engine)
    try:
        async with serving_app(EngineClient(address), tokenizer, gateway_config) as (url, app):
            gateway = Gateway(url, fake_engine, None, app)
            got, resp, _ = await post(gateway, path, {"model": SERVED_NAME, "max_tokens": 2, **body})
            assert got == 400, resp
            assert "--max-waiting 4" in resp["error"]["message"] and resp["error"]["param"] == param
            assert fake_engine.requests == []                  # nothing was queued
            got, _, _ = await post(gateway, path, {"model": SERVED_NAME, "max_tokens": 2, **body, "n": 1})
            assert got == 200                                  # within the limit: served
    finally:
        await server.stop(None)


async def test_engine_down_gives_503_and_unhealthy(tokenizer, gateway_config):
    client = EngineClient("127.0.0.1:1")    # nothing listens there
    app = create_app(gateway_config, client, tokenizer)
    runner, _ = await start_site(app, "127.0.0.1", 0, shutdown_timeout=1.0)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 503
                assert_error(await resp.json(), code="engine_unavailable")
            async with http.get(f"{url}/health") as resp:
                assert resp.status == 503
    finally:
        await runner.cleanup()
        await client.close()


async def test_engine_failure_mid_stream_is_an_error_event(gateway):
    gateway.engine.fail_after = 3
    status, body, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert_error(error, code="engine_error")
    assert "worker exploded" in error["error"]["message"]
    status, body, _ = await post(gateway, "/v1/chat/completions", CHAT)
    assert status == 500
    assert_error(body, code="engine_error")
