"""The gateway follows DNS for its scheduler replicas (--scheduler-discovery-interval, discovery.py): replicas
join when their name resolves to them, leave when it no longer does (requests already there finish), an empty
answer leaves nothing to route to (503), and a failed lookup keeps the replicas known. Real gRPC fake engines,
the real gateway app; only the resolver is scripted (a headless Service's DNS is not available here)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio

from steploop.gateway.config import GatewayConfig
from steploop.gateway.routing import discovery
from steploop.gateway.routing.router import EngineRouter

# The gateway tests' fixtures (a tokenizer folder, a config), imported so pytest finds them here.
from tests.gateway.conftest import (  # noqa: F401
    SERVED_NAME,
    gateway_config,
    gateway_model_dir,
    reply_ids,
    serving_app,
    tokenizer,
    wait_for,
)
from tests.gateway.fake_engine import FakeEngine, start_fake_engine


class ScriptedDNS:
    def __init__(self) -> None:
        self.answer: list[str] | OSError = []
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if isinstance(self.answer, OSError):
            raise self.answer
        return list(self.answer)


@pytest_asyncio.fixture
async def cluster(reply_ids, tokenizer, gateway_config):  # noqa: F811
    engines = [FakeEngine(reply_ids=reply_ids, eos_token_id=reply_ids[-1]) for _ in range(2)]
    started = [await start_fake_engine(e) for e in engines]
    addresses = [address for _, address, _ in started]
    dns = ScriptedDNS()
    router = EngineRouter([], discovered=True, health_interval_s=0.1)
    finder = discovery.SchedulerDiscovery(router, [discovery.Target.parse("engine-headless:50051")],
                                          discovery.client_factory(GatewayConfig().tls, True), 60.0, resolver=dns)
    dns.answer = [addresses[0]]
    await finder.refresh()
    try:
        async with serving_app(router, tokenizer, gateway_config) as (url, _):
            yield url, engines, addresses, dns, finder, router
    finally:
        for server, _, _ in started:
            await server.stop(None)


async def complete(url: str, prompt_ids: list[int]) -> int:
    body = {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": 3}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status


async def test_replicas_join_and_leave_as_dns_changes(cluster):
    url, engines, addresses, dns, finder, router = cluster
    assert dns.asked == [("engine-headless", 50051)]
    assert await complete(url, list(range(1000, 1040))) == 200
    assert [len(e.requests) for e in engines] == [1, 0]

    dns.answer = list(addresses)                       # a second replica became ready
    await finder.refresh()
    assert sorted(r.address for r in router.live) == sorted(addresses)
    for k in range(16):
        assert await complete(url, list(range(2000 + 97 * k, 2040 + 97 * k))) == 200
    assert min(len(e.requests) for e in engines) >= 3, [len(e.requests) for e in engines]

    dns.answer = [addresses[1]]                        # the first one went away
    await finder.refresh()
    assert [r.address for r in router.live] == [addresses[1]]
    before = len(engines[0].requests)
    for k in range(6):
        assert await complete(url, list(range(5000 + 50 * k, 5040 + 50 * k))) == 200
    assert len(engines[0].requests) == before

    dns.answer = OSError("resolver timed out")         # a failed lookup keeps what is known
    await finder.refresh()
    assert [r.address for r in router.live] == [addresses[1]]

    dns.answer = [addresses[0]]                        # it came back: the retired slot is reused
    await finder.refresh()
    assert [r.address for r in router.live] == [addresses[0]] and len(router.replicas) == 2


async def test_no_replica_in_dns_answers_503_and_health_is_down(cluster):
    url, _, addresses, dns, finder, router = cluster
    dns.answer = []
    await finder.refresh()
    assert router.live == [] and not await router.health()
    assert await complete(url, list(range(100, 140))) == 503
    dns.answer = [addresses[1]]
    await finder.refresh()
    assert await complete(url, list(range(100, 140))) == 200


async def test_a_removed_replica_finishes_its_requests_in_flight(cluster):
    url, engines, addresses, dns, finder, _ = cluster
    engines[0].token_delay_s = 0.2
    running = asyncio.create_task(complete(url, list(range(300, 340))))
    await wait_for(lambda: engines[0].requests)       # in flight on replica 0 (3 tokens, 0.2 s each, to go)
    dns.answer = [addresses[1]]
    await finder.refresh()
    assert await running == 200                        # the stream on the removed replica was not cut


async def test_resolve_returns_every_address_of_a_name():
    assert "127.0.0.1:50051" in await discovery.resolve("localhost", 50051)


@pytest.mark.parametrize("entry", ["unix:/tmp/s.sock", "dns:///engine:50051", "engine"])
def test_discovery_needs_name_port(entry):
    with pytest.raises(ValueError, match="name:port"):
        GatewayConfig(scheduler_address=entry, scheduler_discovery_interval=5.0)
