"""Engine control through a gateway in front of two scheduler replicas (two fake engines): pause is all or none
(rolled back with a clear error), weight updates stage on every replica before any switches, a replica that could
not switch is fenced from routing until it serves the deployment's version, and answers list every replica."""

from __future__ import annotations

import random

import aiohttp
import grpc
import pytest_asyncio

from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.router import EngineRouter
from tests.gateway.conftest import SERVED_NAME, serving_app
from tests.gateway.fake_engine import FakeEngine, start_fake_engine

ADMIN = "admin-secret"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


class Replicas:
    def __init__(self, url, engines, addresses):
        self.url, self.engines, self.addresses = url, engines, addresses

    async def call(self, method: str, path: str, **kwargs) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http, \
                http.request(method, self.url + path, headers=HEADERS, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)

    async def complete(self, seed: int) -> int:
        body = {"model": SERVED_NAME, "prompt": random.Random(seed).sample(range(1000, 40000), 64), "max_tokens": 2}
        async with aiohttp.ClientSession() as http, http.post(self.url + "/v1/completions", json=body) as resp:
            return resp.status


@pytest_asyncio.fixture
async def replicas(reply_ids, tokenizer):
    engines = [FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1]) for _ in range(2)]
    started = [await start_fake_engine(e) for e in engines]
    router = EngineRouter([EngineClient(address) for _, address, _ in started], health_interval_s=0.1)
    config = GatewayConfig(port=0, served_model_name=SERVED_NAME, admin_api_key=ADMIN, paused_request_timeout=0.0)
    try:
        async with serving_app(router, tokenizer, config) as (url, _):
            yield Replicas(url, engines, [address for _, address, _ in started])
    finally:
        for server, _, _ in started:
            await server.stop(None)


async def test_pause_is_all_or_none(replicas):
    good, bad = replicas.engines
    bad.control_status = grpc.StatusCode.UNAVAILABLE
    status, body = await replicas.call("POST", "/pause", params={"mode": "keep"})
    assert status == 503 and replicas.addresses[1] in body["error"]["message"]
    assert "nothing changed" in body["error"]["message"]
    assert good.controls == [("pause", "PAUSE_MODE_KEEP"), ("resume",)] and not good.paused   # rolled back
    assert [await replicas.complete(k) for k in range(4)] == [200] * 4          # the gateway is not paused
    bad.control_status = None
    status, body = await replicas.call("POST", "/pause", params={"mode": "keep"})
    assert status == 200 and good.paused and bad.paused
    assert [(r["address"], r["paused"]) for r in body["replicas"]] == [(a, True) for a in replicas.addresses]
    status, body = await replicas.call("POST", "/resume")
    assert status == 200 and not good.paused and not bad.paused


async def test_weight_update_stages_on_every_replica_then_switches_all(replicas):
    status, body = await replicas.call("POST", "/update_weights_from_disk", json={"model_path": "/ckpt/7"})
    assert status == 200 and body["weight_version"] == "1"
    for engine in replicas.engines:
        assert engine.controls == [("update_weights", "/ckpt/7", "", "stage"), ("switch_weights", True, "1")]
    assert [(r["weight_version"], r["fenced"]) for r in body["replicas"]] == [("1", None), ("1", None)]
    restarted = replicas.engines[1]
    restarted.weight_version = "0"                  # its worker restarted from weights no folder holds
    status, body = await replicas.call("GET", "/get_weight_version")
    assert body["weight_version"] == "1,0" and body["replicas"][1]["fenced"].startswith("weights at version 0")
    before = len(restarted.requests)
    assert [await replicas.complete(k) for k in range(6)] == [200] * 6
    assert len(restarted.requests) == before


async def test_a_refused_stage_drops_every_staged_copy(replicas):
    good, bad = replicas.engines
    bad.weights_error = "model.norm.weight: checkpoint shape (10,) != (576,)"
    status, body = await replicas.call("POST", "/update_weights_from_disk", json={"model_path": "/ckpt/x"})
    assert status == 400 and replicas.addresses[1] in body["error"]["message"]
    assert "no replica switched" in body["error"]["message"]
    assert good.controls[-1] == ("switch_weights", False, "") and not good.staged
    assert (good.weight_version, bad.weight_version) == ("0", "0")
    assert [await replicas.complete(k) for k in range(8)] == [200] * 8
    assert len(good.requests) and len(bad.requests)                            # both still routed to


async def test_a_replica_that_did_not_switch_is_fenced_until_it_serves_the_version(replicas):
    good, bad = replicas.engines
    bad.control_status = grpc.StatusCode.UNAVAILABLE                            # its commit fails
    status, body = await replicas.call("POST", "/update_weights_from_disk", json={"model_path": "/ckpt/8"})
    assert (status, body["error"]["code"]) == (503, "weights_diverged")
    assert replicas.addresses[1] in body["error"]["message"]
    assert (good.weight_version, bad.weight_version) == ("1", "0")
    before = len(bad.requests)
    assert [await replicas.complete(k) for k in range(8)] == [200] * 8
    assert len(bad.requests) == before                                          # no client sees the old weights
    status, body = await replicas.call("GET", "/get_weight_version")
    assert body["weight_version"] == "1,0"
    assert body["replicas"][1]["fenced"] and body["replicas"][0]["fenced"] is None
    bad.control_status = None                                                   # repaired: the next update reaches it
    status, body = await replicas.call("POST", "/update_weights_from_disk", json={"model_path": "/ckpt/9"})
    assert status == 200 and body["weight_version"] == "2" and (good.weight_version, bad.weight_version) == ("2", "2")
    assert [r["fenced"] for r in body["replicas"]] == [None, None]
    assert [await replicas.complete(100 + k) for k in range(8)] == [200] * 8
    assert len(bad.requests) > before
