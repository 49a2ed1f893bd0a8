"""The engine control routes at the gateway (fake engine): off without --admin-api-key, the admin key's checks,
pause modes passed through, new requests held while paused (then served, or 503), weight updates and versions."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
import pytest_asyncio

from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from tests.gateway.conftest import SERVED_NAME, Gateway, serving_app
from tests.gateway.fake_engine import start_fake_engine

ADMIN, USER = "admin-secret", "user-secret"
COMPLETION = {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 3}


@pytest_asyncio.fixture
async def admin_gateway(fake_engine, tokenizer, request):
    overrides = getattr(request, "param", {})
    config = GatewayConfig(port=0, served_model_name=SERVED_NAME, api_key=USER, admin_api_key=ADMIN,
                           paused_request_timeout=5.0)
    config = dataclasses.replace(config, **overrides)
    server, address, health = await start_fake_engine(fake_engine)
    try:
        async with serving_app(EngineClient(address), tokenizer, config) as (url, app):
            yield Gateway(url, fake_engine, health, app)
    finally:
        await server.stop(None)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _call(method: str, url: str, key: str | None = ADMIN, **kwargs) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, \
            session.request(method, url, headers=_auth(key) if key else {}, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_control_routes_are_404_without_an_admin_key(gateway):
    for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                         ("POST", "/update_weights_from_disk"), ("GET", "/get_weight_version"),
                         ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed")):
        status, body = await _call(method, gateway.url + path, key=None)
        assert status == 404, (path, body)
    assert gateway.engine.controls == []


async def test_admin_key_is_required_and_the_user_key_is_forbidden(admin_gateway):
    url = admin_gateway.url + "/pause"
    status, body = await _call("POST", url, key=None)
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    status, body = await _call("POST", url, key="wrong")
    assert status == 401
    status, body = await _call("POST", url, key=USER)
    assert (status, body["error"]["type"], body["error"]["code"]) == (403, "permission_error", "permission_denied")
    assert admin_gateway.engine.controls == []
    status, body = await _call("POST", url)
    assert status == 200 and body["paused"] is True
    # the admin key is not a user key: /v1 still wants the user's
    status, _ = await _call("POST", admin_gateway.url + "/v1/completions", key=ADMIN, json=COMPLETION)
    assert status == 401


def test_admin_key_must_differ_from_the_user_key():
    with pytest.raises(ValueError, match="must differ"):
        GatewayConfig(api_key="same", admin_api_key="same")
    with pytest.raises(ValueError, match="paused-request-timeout"):
        GatewayConfig(paused_request_timeout=-1)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_pause_modes_reach_the_engine(admin_gateway, mode):
    status, body = await _call("POST", admin_gateway.url + f"/pause?mode={mode}")
    assert status == 200 and body["mode"] == mode
    assert admin_gateway.engine.controls == [("pause", f"PAUSE_MODE_{mode.upper()}")]
    status, body = await _call("GET", admin_gateway.url + "/is_paused")
    assert body == {"is_paused": True}


async def test_unknown_pause_mode_is_a_400_naming_it(admin_gateway):
    status, body = await _call("POST", admin_gateway.url + "/pause?mode=sleep")
    assert (status, body["error"]["param"]) == (400, "mode")
    assert admin_gateway.engine.controls == []


async def test_requests_wait_while_paused_and_run_after_resume(admin_gateway):
    await _call("POST", admin_gateway.url + "/pause?mode=keep")
    held = asyncio.ensure_future(_call("POST", admin_gateway.url + "/v1/completions", key=USER, json=COMPLETION))
    await asyncio.sleep(0.3)             # a request that was not held would have finished by now
    assert not held.done() and admin_gateway.engine.requests == []
    status, body = await _call("POST", admin_gateway.url + "/resume")
    assert status == 200 and body["paused"] is False
    status, body = await asyncio.wait_for(held, 5)
    assert status == 200 and body["choices"][0]["text"]
    assert admin_gateway.engine.controls[-1] == ("resume",)


@pytest.mark.parametrize("admin_gateway", [{"paused_request_timeout": 0.0}], indirect=True)
async def test_requests_get_503_while_paused_with_no_wait(admin_gateway):
    await _call("POST", admin_gateway.url + "/pause")
    status, body = await _call("POST", admin_gateway.url + "/v1/completions", key=USER, json=COMPLETION)
    assert (status, body["error"]["code"]) == (503, "engine_paused")
    assert admin_gateway.engine.requests == []


async def test_update_weights_reports_the_version(admin_gateway):
    url = admin_gateway.url
    status, body = await _call("POST", url + "/update_weights_from_disk", json={"model_path": "/ckpt/step-7"})
    assert status == 200 and body["success"] is True and body["weight_version"] == "1"
    assert admin_gateway.engine.controls == [("update_weights", "/ckpt/step-7", "")]
    async with aiohttp.ClientSession() as session, \
            session.post(url + "/v1/completions", headers=_auth(USER), json=COMPLETION) as resp:
        assert resp.status == 200 and resp.headers["x-steploop-weight-version"] == "1"
    status, body = await _call("POST", url + "/update_weights_from_disk",
                               json={"model_path": "/ckpt/step-8", "weight_version": "step-8"})
    assert body["weight_version"] == "step-8"
    assert (await _call("GET", url + "/get_weight_version"))[1] == {"weight_version": "step-8"}


async def test_refused_weight_update_is_a_400(admin_gateway):
    admin_gateway.engine.weights_error = "model.embed_tokens.weight: checkpoint shape (10, 4) != (49152, 576)"
    status, body = await _call("POST", admin_gateway.url + "/update_weights_from_disk", json={"model_path": "/x"})
    assert status == 400 and "checkpoint shape" in body["error"]["message"]
    status, body = await _call("POST", admin_gateway.url + "/update_weights_from_disk", json={})
    assert (status, body["error"]["param"]) == (400, "model_path")


async def test_sleep_holds_requests_and_wake_up_serves_them(admin_gateway):
    url = admin_gateway.url
    assert (await _call("POST", url + "/sleep?level=3"))[0] == 400
    status, body = await _call("POST", url + "/sleep?level=2")
    assert status == 200 and body["sleep_level"] == 2 and body["worker_rss_bytes"] == [1 << 20]
    held = asyncio.ensure_future(_call("POST", url + "/v1/completions", key=USER, json=COMPLETION))
    await asyncio.sleep(0.3)
    assert not held.done()
    status, body = await _call("POST", url + "/wake_up")
    assert status == 200 and body["paused"] is False and body["worker_rss_bytes"] == [2 << 20]
    assert (await asyncio.wait_for(held, 5))[0] == 200
    assert admin_gateway.engine.controls == [("sleep", 2), ("wake_up",)]
    assert (await _call("GET", url + "/is_sleeping"))[1] == {"is_sleeping": False}
    assert (await _call("POST", url + "/sleep", key=USER))[0] == 403


async def test_distributed_weight_routes_validate_and_reach_the_engine(admin_gateway):
    url = admin_gateway.url
    group = {"master_address": "10.0.0.5", "master_port": 29500, "world_size": 3}
    status, body = await _call("POST", url + "/init_weights_update_group", json=group)
    assert status == 200 and body["success"] is True
    assert admin_gateway.engine.controls == [("init_group", "10.0.0.5", 29500, 1, 3)]
    for bad, param in (({**group, "world_size": 1}, "world_size"), ({**group, "backend": "nccl"}, "backend"),
                       ({"master_port": 1, "world_size": 2}, "master_address")):
        status, body = await _call("POST", url + "/init_weights_update_group", json=bad)
        assert (status, body["error"]["param"]) == (400, param), body
    bucket = {"tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [128]}], "sha256": "ab" * 32}
    status, body = await _call("POST", url + "/update_weights_from_distributed",
                               json={"buckets": [bucket], "weight_version": "rl-3"})
    assert status == 200 and body["weight_version"] == "rl-3"
    assert admin_gateway.engine.controls[-1] == ("update_distributed", [("model.norm.weight", "float32", [128])],
                                                 ["ab" * 32])
    status, body = await _call("POST", url + "/update_weights_from_distributed",
                               json={"buckets": [{"tensors": [{"name": "x", "shape": [-1]}]}]})
    assert (status, body["error"]["param"]) == (400, "buckets")


async def test_a_gateway_started_while_the_engine_is_paused_holds_requests(fake_engine, tokenizer):
    fake_engine.paused = True
    config = GatewayConfig(port=0, served_model_name=SERVED_NAME, paused_request_timeout=0.0)
    server, address, _ = await start_fake_engine(fake_engine)
    try:
        async with serving_app(EngineClient(address), tokenizer, config) as (url, _):
            status, body = await _call("POST", url + "/v1/completions", key=None, json=COMPLETION)
            assert (status, body["error"]["code"]) == (503, "engine_paused")
    finally:
        await server.stop(None)
