"""Request migration across two fake scheduler replicas: a stream whose replica drops its Session mid-generation,
or stops serving (drain), goes on on the other one from the tokens already delivered; the client sees the same
events as an undisturbed run. The real engine's side (resumed outputs) is tested in tests/scheduler and
tests/worker; real processes in tests/migration."""

from __future__ import annotations

import json
from dataclasses import replace

import aiohttp
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2

from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.router import EngineRouter
from tests.gateway.conftest import SERVED_NAME, serving_app
from tests.gateway.fake_engine import FakeEngine, start_fake_engine

REPLY = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"


class Pair:
    def __init__(self, url, engines, healths, router):
        self.url, self.engines, self.healths, self.router = url, engines, healths, router

    def holder(self) -> int:
        """The replica that got the request first."""
        return next(i for i, e in enumerate(self.engines) if e.requests)


@pytest_asyncio.fixture(params=[True, False], ids=["session", "generate-calls"])
async def pair(request, tokenizer, gateway_config):
    ids = tokenizer.encode_sync(REPLY, add_special_tokens=False)
    engines = [FakeEngine(reply_ids=ids, token_delay_s=0.03) for _ in range(2)]
    started = [await start_fake_engine(e) for e in engines]
    router = EngineRouter([EngineClient(address, multiplex=request.param) for _, address, _ in started],
                          cooldown_s=30.0, health_interval_s=0.05, max_migrations=1)
    try:
        async with serving_app(router, tokenizer, replace(gateway_config, max_migrations=1)) as (url, _):
            yield Pair(url, engines, [h for _, _, h in started], router)
    finally:
        for server, _, _ in started:
            await server.stop(None)


async def stream_events(pair: Pair, body: dict, disrupt=None, after: int = 4) -> list[dict]:
    """The SSE events of a streamed completion; `disrupt()` runs once `after` events have arrived."""
    events = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{pair.url}/v1/completions", json={"model": SERVED_NAME, "stream": True, **body}) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    break
                event = json.loads(line[6:])
                assert "error" not in event, event
                events.append({k: v for k, v in event.items() if k not in ("id", "created")})
                if len(events) == after and disrupt is not None:
                    await disrupt()
    return events


def by_choice(events: list[dict]) -> dict:
    """Each choice's events in order, and the usage event(s): choices interleave as their engines answer."""
    out: dict = {"usage": [e["usage"] for e in events if e.get("usage")]}
    for event in events:
        for c in event["choices"]:
            out.setdefault(c["index"], []).append(c)
    return out


def text_of(events: list[dict], index: int = 0) -> str:
    return "".join(c["text"] for e in events for c in e["choices"] if c["index"] == index)


PROMPT = "Count: " * 40     # long enough that affinity puts both choices on one replica
BODY = {"prompt": PROMPT, "max_tokens": 12, "n": 2, "logprobs": 1, "stop": ["ten"], "stream_options":
        {"include_usage": True}}


async def test_a_dropped_session_migrates_every_choice_with_the_same_events(pair):
    undisturbed = await stream_events(pair, BODY)
    for engine in pair.engines:
        engine.requests.clear(), engine.cancelled.clear(), engine.finished.clear()

    victim = []

    async def kill_holder():
        victim.append(pair.holder())
        pair.engines[victim[0]].drop_sessions()

    moved = await stream_events(pair, BODY, kill_holder)
    assert by_choice(moved) == by_choice(undisturbed)
    assert text_of(moved, 0) == text_of(moved, 1) == REPLY[:REPLY.index("ten")]
    assert len(pair.engines[victim[0]].requests) == 2          # both choices ran there first
    other = pair.engines[1 - victim[0]]
    resumed = [r for r in other.requests if r.resume_output_token_ids]
    assert len(resumed) == 2 and all(len(r.resume_output_token_ids) >= 1 for r in resumed)
    assert all(not r.sampling.HasField("prompt_logprobs") for r in resumed)
    samples = pair.router.migration.migrations.labels("replica_unavailable")._value.get()
    assert samples == 2


async def test_a_replica_that_stops_serving_hands_its_streams_over(pair):
    undisturbed = await stream_events(pair, BODY)
    for engine in pair.engines:
        engine.requests.clear(), engine.cancelled.clear(), engine.finished.clear()

    victim = []

    async def drain_holder():
        victim.append(pair.engines[pair.holder()])
        await pair.healths[pair.holder()].set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    moved = await stream_events(pair, BODY, drain_holder)
    assert by_choice(moved) == by_choice(undisturbed)
    # The draining replica was told to drop both choices (an abort of the undisturbed run's requests, sent when
    # their stop string matched, may land after the clear above: only this stream's ids count).
    moved_ids = {r.request_id for r in victim[0].requests}
    assert len(moved_ids) == 2 and moved_ids <= set(victim[0].cancelled)
    assert not moved_ids & set(victim[0].finished)
    assert pair.router.migration.migrations.labels("replica_draining")._value.get() == 2
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{pair.url}/metrics") as resp:
            text = await resp.text()
    assert 'steploop:request_migrations_total{reason="replica_draining"} 2.0' in text


async def test_past_max_migrations_it_fails_as_before(pair):
    """--max-migrations 1 here: the first drop moves the stream, the second one ends it with the error."""
    async with aiohttp.ClientSession() as http:
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 12, "stream": True}
        async with http.post(f"{pair.url}/v1/completions", json=body) as resp:
            events, holder = [], None
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:        # the first holder, then the replica it moved to
                        holder = pair.holder()
                        pair.engines[holder].drop_sessions()
                    elif len(events) == 6:
                        pair.engines[1 - holder].drop_sessions()
    assert events[-1]["error"]["code"] == "engine_unavailable", events[-3:]
    assert len(events) >= 7 and REPLY.startswith(text_of(events[:-1]))
    assert pair.router.migration.failures.labels("replica_unavailable")._value.get() == 1


@pytest.mark.parametrize("flag", ["0", "-1"])
def test_the_flag(flag):
    import argparse

    from steploop.gateway.config import GatewayConfig, add_cli_args

    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--max-migrations", flag])
    if flag == "-1":
        with pytest.raises(ValueError, match="--max-migrations"):
            GatewayConfig.from_args(args)
    else:
        assert GatewayConfig.from_args(args).max_migrations == 0
    assert GatewayConfig().max_migrations == 3
