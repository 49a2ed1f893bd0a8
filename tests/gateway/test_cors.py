"""CORS as vLLM serves it: any origin by default, preflights answered before the API-key check, streamed responses
carrying the header too, and a listed origin (with credentials) echoed instead of '*'."""

from __future__ import annotations

import argparse
from dataclasses import replace

import aiohttp
import pytest

from steploop.gateway.config import GatewayConfig, add_cli_args
from steploop.gateway.cors import CorsPolicy, parse_list
from tests.gateway.conftest import SERVED_NAME

CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
PAGE = "https://app.example"


@pytest.fixture
def gateway_config(gateway_config, request):
    changes = getattr(request, "param", None) or {}
    return replace(gateway_config, **changes)


def _preflight(method="POST", headers="authorization, content-type", origin=PAGE):
    return {"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}


@pytest.mark.parametrize("gateway_config", [{"api_key": "s3cret"}], indirect=True)
async def test_default_allows_any_origin_and_preflights_need_no_key(gateway, reply):
    reply("Hello there")
    async with aiohttp.ClientSession() as http:
        async with http.options(f"{gateway.url}/v1/chat/completions", headers=_preflight()) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == "*"
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            assert "Access-Control-Allow-Credentials" not in resp.headers
        auth = {"Origin": PAGE, "Authorization": "Bearer s3cret"}
        async with http.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers=auth) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"
        async with http.post(f"{gateway.url}/v1/chat/completions", json={**CHAT, "stream": True},
                             headers=auth) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"
            assert b"[DONE]" in await resp.read()
        async with http.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers={"Origin": PAGE}) as resp:
            assert resp.status == 401                                   # the key is still required
            assert resp.headers["Access-Control-Allow-Origin"] == "*"   # and the page can read why
        async with http.post(f"{gateway.url}/v1/chat/completions", json=CHAT,
                             headers={"Authorization": "Bearer s3cret"}) as resp:
            assert "Access-Control-Allow-Origin" not in resp.headers   # no Origin: not a CORS request
        async with http.options(f"{gateway.url}/v1/chat/completions", headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 405                                   # a plain OPTIONS is not a preflight


@pytest.mark.parametrize("gateway_config", [{"cors": CorsPolicy(allowed_origins=(PAGE,), allowed_methods=("POST",),
                                                                 allowed_headers=("content-type",),
                                                                 allow_credentials=True)}], indirect=True)
async def test_listed_origins_methods_and_headers(gateway, reply):
    reply("Hello")
    async with aiohttp.ClientSession() as http:
        async with http.options(f"{gateway.url}/v1/completions", headers=_preflight(headers="content-type")) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == PAGE
            assert resp.headers["Access-Control-Allow-Credentials"] == "true"
            assert resp.headers["Access-Control-Allow-Methods"] == "POST"
            assert resp.headers["Vary"] == "Origin"
        for bad, named in ((_preflight(origin="https://evil.example", headers="content-type"), "origin"),
                           (_preflight(method="DELETE", headers="content-type"), "method"),
                           (_preflight(headers="content-type, x-custom"), "headers")):
            async with http.options(f"{gateway.url}/v1/completions", headers=bad) as resp:
                assert resp.status == 400 and named in await resp.text()
        async with http.post(f"{gateway.url}/v1/chat/completions", json=CHAT,
                             headers={"Origin": "https://evil.example"}) as resp:
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
        async with http.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers={"Origin": PAGE}) as resp:
            assert resp.headers["Access-Control-Allow-Origin"] == PAGE and "Origin" in resp.headers["Vary"]


def test_flags_take_vllm_json_lists_or_commas(monkeypatch):
    parser = add_cli_args(argparse.ArgumentParser())
    config = GatewayConfig.from_args(parser.parse_args(
        ["--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-methods", "GET,post",
         "--allow-credentials"]))
    assert config.cors == CorsPolicy(allowed_origins=("https://a.example", "https://b.example"),
                                     allowed_methods=("GET", "POST"), allowed_headers=("*",), allow_credentials=True)
    assert GatewayConfig.from_args(parser.parse_args([])).cors == CorsPolicy()
    with pytest.raises(argparse.ArgumentTypeError):
        parse_list('["unclosed"')
    with pytest.raises(argparse.ArgumentTypeError):
        parse_list("[1, 2]")
