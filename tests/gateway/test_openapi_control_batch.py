"""/openapi.json lists the Batch API and (with --admin-api-key) the engine control routes, and schemathesis,
fuzzing exactly those operations from the document with the admin key, gets no 5xx from any of them (fake engine:
fast; tests/integration/test_api_endpoints.py fuzzes the whole document against the real engine)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest_asyncio
from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.server import start_batches

from tests.gateway.conftest import SERVED_NAME, Gateway, serving_app
from tests.gateway.fake_engine import start_fake_engine
from tests.openapi_fuzz import fuzz_operation

ADMIN = "admin-secret"
CONTROL = {"/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping", "/update_weights_from_disk",
           "/get_weight_version", "/init_weights_update_group", "/update_weights_from_distributed"}
BATCH = {"/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}",
         "/v1/batches/{batch_id}/cancel"}


@pytest_asyncio.fixture
async def full_gateway(fake_engine, tokenizer, tmp_path):
    config = GatewayConfig(port=0, served_model_name=SERVED_NAME, admin_api_key=ADMIN, paused_request_timeout=0.0,
                           batch_dir=str(tmp_path / "batches"))
    server, address, health = await start_fake_engine(fake_engine)
    try:
        async with serving_app(EngineClient(address), tokenizer, config) as (url, app):
            start_batches(app, "127.0.0.1", int(url.rsplit(":", 1)[1]))
            yield Gateway(url, fake_engine, health, app)
    finally:
        await server.stop(None)


async def _spec(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url + "/openapi.json") as resp:
        return await resp.json()


async def test_the_document_lists_the_routes_this_gateway_serves(full_gateway, fake_engine, tokenizer, tmp_path):
    spec = await _spec(full_gateway.url)
    assert CONTROL | BATCH <= set(spec["paths"])
    assert spec["paths"]["/pause"]["post"]["security"] == [{"admin": []}]
    assert "admin" in spec["components"]["securitySchemes"]
    # No --admin-api-key, and its batch folder is the one full_gateway holds: this gateway serves neither
    plain_config = GatewayConfig(port=0, served_model_name=SERVED_NAME, batch_dir=str(tmp_path / "batches"))
    server, address, _ = await start_fake_engine(fake_engine)
    try:
        async with serving_app(EngineClient(address), tokenizer, plain_config) as (url, _):
            plain = await _spec(url)
    finally:
        await server.stop(None)
    assert not (CONTROL | BATCH) & set(plain["paths"])


def _fuzz(spec: dict, base_url: str) -> list[str]:
    """Up to 12 generated requests per operation, with the admin key; a 5xx, a timeout or a dropped connection
    is a failure."""
    import schemathesis

    failures: list[str] = []
    deadline = time.monotonic() + 60
    headers = {"Authorization": f"Bearer {ADMIN}"}
    for operation in schemathesis.openapi.from_dict(spec).get_all_operations():
        op = operation.ok()
        if op.path in CONTROL | BATCH:
            fuzz_operation(op, base_url, failures, deadline, examples=12, headers=headers, timeout=30)
    return failures


async def test_schemathesis_finds_no_server_errors_in_the_control_and_batch_routes(full_gateway):
    spec = await _spec(full_gateway.url)
    spec["servers"] = [{"url": full_gateway.url}]
    failures = await asyncio.to_thread(_fuzz, spec, full_gateway.url)   # the gateway serves on this loop
    assert failures == []
    async with aiohttp.ClientSession() as http:         # and it still serves: resumed, awake
        for path in ("/wake_up", "/resume"):
            async with http.post(full_gateway.url + path, headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
                assert resp.status == 200, await resp.text()
        body = {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2}
        async with http.post(full_gateway.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
