"""One gateway in front of two scheduler replicas (two fake engines): prefix affinity, load spill-over, failover,
health and one merged /metrics."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest_asyncio
from grpc_health.v1 import health_pb2

from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.affinity import AffinityMap
from steploop.gateway.routing.router import EngineRouter
from tests.gateway.conftest import SERVED_NAME, serving_app
from tests.gateway.fake_engine import FakeEngine, start_fake_engine


class TwoReplicas:
    def __init__(self, url, engines, started, router):
        self.url, self.engines, self.router = url, engines, router
        self.servers = [server for server, _, _ in started]
        self.healths = [health for _, _, health in started]
        self.addresses = [address for _, address, _ in started]

    def counts(self) -> list[int]:
        return [len(e.requests) for e in self.engines]

    async def routed_to(self, http, i: int, up: bool, timeout: float = 10.0) -> None:
        """Until the gateway's /metrics says it routes new requests to replica i (steploop:replica_up 1), or not."""
        head = f'steploop:replica_up{{replica="{self.addresses[i]}"}} '
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            async with http.get(f"{self.url}/metrics") as resp:
                lines = (await resp.text()).splitlines()
            if [float(line[len(head):]) for line in lines if line.startswith(head)] == [float(up)]:
                return
            assert asyncio.get_running_loop().time() < deadline, f"replica {i} never became up={up}"
            await asyncio.sleep(0.02)       # a poll interval

    async def complete(self, http, prompt_ids, **extra):
        body = {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": 4, **extra}
        async with http.post(f"{self.url}/v1/completions", json=body) as resp:
            return resp.status, await resp.json()


@pytest_asyncio.fixture
async def two(reply_ids, tokenizer, gateway_config):
    engines = [FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1]) for _ in range(2)]
    started = [await start_fake_engine(e) for e in engines]
    router = EngineRouter([EngineClient(address) for _, address, _ in started], cooldown_s=30.0,
                          health_interval_s=0.1)
    try:
        async with serving_app(router, tokenizer, gateway_config) as (url, _):
            yield TwoReplicas(url, engines, started, router)
    finally:
        for server, _, _ in started:
            await server.stop(None)


def prompt(seed: int, n: int = 64) -> list[int]:
    return random.Random(seed).sample(range(1000, 40000), n)


async def test_same_prefix_goes_to_the_same_replica_and_different_ones_spread(two):
    shared = prompt(0, 96)
    async with aiohttp.ClientSession() as http:
        for k in range(6):   # one system prompt, six different questions: 96 of 112 tokens shared
            status, _ = await two.complete(http, shared + prompt(100 + k, 16))
            assert status == 200
        assert sorted(two.counts()) == [0, 6]
        for k in range(24):  # unrelated prompts spread (rendezvous hashing of the whole prompt)
            assert (await two.complete(http, prompt(1000 + k)))[0] == 200
    assert min(two.counts()) >= 4, two.counts()


async def test_new_conversations_with_one_template_header_spread(two):
    """Chat prompts start with the same template header (32 tokens here) and differ after it: one at a time they
    must not all land on one replica (the header alone covers too little of the prompt to count as affinity)."""
    header = prompt(5, 32)
    async with aiohttp.ClientSession() as http:
        for k in range(20):
            assert (await two.complete(http, header + prompt(500 + k, 24)))[0] == 200
    assert min(two.counts()) >= 4, two.counts()


async def test_a_loaded_replica_spills_over(two):
    """30 overlapping streams of one prompt: affinity alone would send all 30 to one replica."""
    for engine in two.engines:
        engine.token_delay_s = 0.05
    same = prompt(7)
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(two.complete(http, same, max_tokens=12) for _ in range(30)))
    assert all(status == 200 for status, _ in results)
    assert min(two.counts()) >= 5, two.counts()
    assert all(r.in_flight == 0 for r in two.router.replicas)


async def test_a_replica_that_is_down_is_routed_around(two):
    await two.servers[0].stop(None)          # replica 0 is gone (its address refuses connections)
    async with aiohttp.ClientSession() as http:
        for k in range(8):
            status, body = await two.complete(http, prompt(200 + k))
            assert status == 200, body
        async with http.get(f"{two.url}/health") as resp:
            assert resp.status == 200       # one replica serving is enough
    assert two.counts()[1] == 8
    assert two.router.replicas[0].down_until > 0       # marked down: later requests skip it without trying


async def test_a_replica_not_serving_gets_no_new_requests(two):
    """grpc health NOT_SERVING (no worker attached, hung, draining): the poller routes around it, and back."""
    async with aiohttp.ClientSession() as http:
        assert (await two.complete(http, prompt(0)))[0] == 200        # starts the health poller
        await two.healths[0].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await two.routed_to(http, 0, up=False)                        # the health poller saw it
        before = two.counts()
        for k in range(8):
            assert (await two.complete(http, prompt(300 + k)))[0] == 200
        assert two.counts()[0] == before[0] and two.counts()[1] == before[1] + 8
        await two.healths[0].set("", health_pb2.HealthCheckResponse.SERVING)
        await two.routed_to(http, 0, up=True)
        for k in range(16):
            assert (await two.complete(http, prompt(400 + k)))[0] == 200
        assert two.counts()[0] > before[0]                            # back in rotation


async def test_all_replicas_down_is_503(two):
    for server in two.servers:
        await server.stop(None)
    async with aiohttp.ClientSession() as http:
        status, body = await two.complete(http, prompt(3))
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        async with http.get(f"{two.url}/health") as resp:
            assert resp.status == 503


async def test_metrics_show_every_replica_once_labelled(two):
    async with aiohttp.ClientSession() as http:
        await two.complete(http, prompt(1))
        async with http.get(f"{two.url}/metrics") as resp:
            text = await resp.text()
    for address in two.router.address.split(","):
        assert f'vllm:num_requests_running{{model_name="fake",replica="{address}"}}' in text
        assert f'vllm:prompt_tokens_total{{model_name="fake",replica="{address}"}}' in text
        assert f'steploop:replica_up{{replica="{address}"}} 1.0' in text
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert "http_requests_total" in text and "steploop:replica_routed_total" in text
    await two.servers[1].stop(None)                 # a replica that stops answering: still named, as down
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{two.url}/health") as resp:
            assert resp.status == 200
        async with http.get(f"{two.url}/metrics") as resp:
            text = await resp.text()
    dead = two.router.replicas[1].address
    assert f'steploop:replica_up{{replica="{dead}"}} 0.0' in text
    assert f'vllm:num_requests_running{{model_name="fake",replica="{dead}"}}' not in text


def test_affinity_map_chains_blocks_and_forgets_the_oldest():
    m = AffinityMap(block_size=4, capacity=6)
    a, b = m.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]), m.block_hashes([1, 2, 3, 4, 9, 9, 9, 9])
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]       # block 2's hash depends on block 1
    m.record(a, 0)
    assert m.deepest(b) == (0, 1) and m.deepest(a) == (0, 2)
    m.record(m.block_hashes(list(range(100, 120))), 1)          # 5 more blocks: the LRU keeps 6
    assert len(m._map) == 6 and m.deepest(b) is None            # a's first block, the oldest, was forgotten
