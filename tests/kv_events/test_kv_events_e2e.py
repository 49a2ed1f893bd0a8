"""KV events from real processes (scheduler + worker + gateway, the real model): vLLM's ZMQ wire format with
sha256_cbor hashes, Engine.WatchKVEvents' snapshot + stream + lossless reconnect, and the gateway's router sending
a prompt to the replica that really holds its prefix after the other one's cache was evicted or restarted."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import grpc
import pytest

from steploop.client import EngineClient, EngineRequest, SamplingParams
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.scheduler.kv_events.zmq_wire import BlockRemoved, BlockStored
from tests.integration.cluster import MODEL, Cluster, free_port, two_replicas
from tests.kv_events.helpers import expected_chain, low64
from tests.kv_events.test_zmq_vllm_wire import Subscriber

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 48        # small: a few distinct prompts evict everything
WORKER_ARGS = ["--max-model-len", "512"]   # so that one sequence fits the small pool


def events_args(pub: int | None = None, replay: int | None = None) -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "null"}
    if pub:
        config.update(publisher="zmq", endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}", topic="kv")
    return ["--kv-events-config", json.dumps(config), "--prefix-caching-hash-algo", "sha256_cbor"]


def prompt(seed: int, n: int) -> list[int]:
    return random.Random(seed).sample(range(1000, 40000), n)


async def generate(address: str, ids: list[int], rid: str) -> int:
    """Runs one request to its end on the scheduler at `address`; returns its cached prompt tokens."""
    client = EngineClient(address)
    try:
        cached = 0
        async for chunk in client.generate(EngineRequest(rid, ids, SamplingParams(max_tokens=1))):
            if chunk.usage is not None:
                cached = chunk.usage.cached_tokens
        return cached
    finally:
        await client.close()


def wait_serving(address: str, tries: int = 600) -> None:
    """Until the scheduler at `address` (just restarted) listens and its worker re-attached: a request runs."""
    from steploop.gateway.errors import APIError
    for i in range(tries):
        try:
            asyncio.run(generate(address, [9, 9, 9], f"probe-{i}"))
            return
        except APIError:
            import time
            time.sleep(0.2)    # a retry interval while the process starts
    raise AssertionError(f"{address} never served again")


async def block_size_of(address: str) -> int:
    client = EngineClient(address)
    try:
        block_size = (await client.model_info()).block_size
        assert block_size, f"{address} has no worker attached (block size 0)"
        return block_size
    finally:
        await client.close()


@pytest.fixture(scope="module")
def zmq_cluster(tmp_path_factory, model_dir):
    pub, replay = free_port(), free_port()
    cluster = Cluster(tmp_path_factory.mktemp("kv-events"), scheduler_args=events_args(pub, replay),
                      worker_args=WORKER_ARGS, num_kv_blocks=NUM_KV_BLOCKS)
    try:
        cluster.start()
        yield cluster, pub, replay
    finally:
        cluster.stop()


def test_zmq_subscriber_sees_vllm_events_with_sha256_cbor_hashes(zmq_cluster):
    cluster, pub, replay = zmq_cluster
    bs = asyncio.run(block_size_of(cluster.scheduler_address))
    sub = Subscriber(pub, replay)
    try:
        first = prompt(1, 3 * bs + 5)
        asyncio.run(generate(cluster.scheduler_address, first, "first"))
        sub.recover(0)                      # a new subscriber asks the replay socket for everything so far
        want = [low64(h) for h in expected_chain(first, bs)]

        def stored_hashes():
            return [h for _, b in sorted(sub.batches.items()) for e in b.events if isinstance(e, BlockStored)
                    for h in e.block_hashes]
        for _ in range(20):                 # the publisher thread may still be sending the last batch
            if set(want) <= set(stored_hashes()):
                break
            if not sub.poll_once(1000):
                sub.recover(sub.next_seq)
        stored = stored_hashes()
        assert stored[:3] == want and len(stored) == len(set(stored)), stored   # one entry per full block
        for i in range(8):                  # distinct prompts until the first one's blocks are reused
            asyncio.run(generate(cluster.scheduler_address, prompt(100 + i, 8 * bs), f"fill-{i}"))
        while sub.poll_once(2000):          # live batches (and any gap through replay)
            pass
        removed = {h for b in sub.batches.values() for e in b.events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes}
        assert set(want) <= removed
        assert sorted(sub.batches) == list(range(sub.next_seq))        # every batch, none missing
    finally:
        sub.close()


async def _watch(stub, from_sequence=0, instance_id=""):
    return stub.WatchKVEvents(engine_pb2.KvEventWatchRequest(from_sequence=from_sequence, instance_id=instance_id))


async def _watch_scenario(address: str, bs: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        call = await _watch(stub)
        snap = (await asyncio.wait_for(call.read(), 30)).snapshot
        assert snap.hash_algo == "sha256_cbor" and snap.block_size == bs and snap.instance_id
        cached = set(snap.block_hashes)
        p = prompt(7, 2 * bs + 3)
        await generate(address, p, "watched")
        while not set(expected_chain(p, bs)) <= cached:
            message = await asyncio.wait_for(call.read(), 30)
            assert message.batch.sequence == snap.sequence + 0 or message.batch.sequence >= snap.sequence
            for event in message.batch.events:
                if event.HasField("stored"):
                    cached.update(event.stored.block_hashes)
            next_sequence = message.batch.sequence + 1
        call.cancel()
        q = prompt(8, 2 * bs + 3)
        await generate(address, q, "missed")                  # while no one watches
        again = await _watch(stub, next_sequence, snap.instance_id)
        message = await asyncio.wait_for(again.read(), 30)
        assert message.WhichOneof("message") == "batch" and message.batch.sequence == next_sequence
        stored = {h for e in message.batch.events if e.HasField("stored") for h in e.stored.block_hashes}
        while not set(expected_chain(q, bs)) <= stored:
            message = await asyncio.wait_for(again.read(), 30)
            stored |= {h for e in message.batch.events if e.HasField("stored") for h in e.stored.block_hashes}
        again.cancel()


def test_watch_kv_events_snapshot_stream_and_reconnect(zmq_cluster):
    cluster, _, _ = zmq_cluster
    bs = asyncio.run(block_size_of(cluster.scheduler_address))
    asyncio.run(_watch_scenario(cluster.scheduler_address, bs))


# ---- the router, two replicas ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replica_pair(tmp_path_factory, model_dir):
    with two_replicas(tmp_path_factory, "events", scheduler_args=events_args(), worker_args=WORKER_ARGS,
                      num_kv_blocks=NUM_KV_BLOCKS) as pair:
        yield pair


async def next_sequence(address: str) -> int:
    """The scheduler's next KV event batch: every batch before it is out (a fresh snapshot says so)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = await _watch(engine_pb2_grpc.EngineStub(channel))
        snap = (await asyncio.wait_for(call.read(), 30)).snapshot
        call.cancel()
        return snap.sequence


def wait_router_synced(gateway: Cluster, replicas: list[Cluster]) -> None:
    """Until the gateway's router applied every batch each replica has sent (its /metrics gauge says so)."""
    import time
    import urllib.request
    wanted = {r.scheduler_address: asyncio.run(next_sequence(r.scheduler_address)) for r in replicas}
    for _ in range(600):
        with urllib.request.urlopen(gateway.base_url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        seen = {address: any(line.startswith(f'steploop:replica_kv_events_sequence{{replica="{address}"}}') and
                             float(line.rsplit(" ", 1)[1]) >= seq for line in text.splitlines())
                for address, seq in wanted.items()}
        if all(seen.values()):
            return
        time.sleep(0.05)     # a poll interval, not a wait for something to happen by itself
    raise AssertionError(f"router never caught up with {wanted}")


def routed(gateway: Cluster, ids: list[int], want: Cluster, bs: int, shared: int, replicas: list[Cluster]) -> None:
    """The request goes to `want` (the header says so), which finds the shared prefix cached (usage says so)."""
    import urllib.request
    wait_router_synced(gateway, replicas)
    request = urllib.request.Request(gateway.base_url + "/v1/completions", method="POST", data=json.dumps(
        {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        body, headers = json.loads(resp.read()), resp.headers
    assert headers["x-steploop-route-source"] == "events", dict(headers)
    assert headers["x-steploop-replica"] == want.scheduler_address, dict(headers)
    assert int(headers["x-steploop-prefix-match-tokens"]) >= shared // bs * bs
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared // bs * bs


def test_the_router_follows_the_real_cache_through_eviction_and_restart(replica_pair):
    a, b = replica_pair
    bs = asyncio.run(block_size_of(a.scheduler_address))
    shared = prompt(20, 12 * bs)
    asyncio.run(generate(b.scheduler_address, shared + [5], "direct-b"))   # the gateway never sent it anywhere
    routed(a, shared + prompt(21, 8), want=b, bs=bs, shared=len(shared), replicas=[a, b])
    for i in range(6):                                                     # evict it from B
        asyncio.run(generate(b.scheduler_address, prompt(300 + i, 8 * bs), f"evict-{i}"))
    asyncio.run(generate(a.scheduler_address, shared + [6], "direct-a"))   # and now A holds it
    routed(a, shared + prompt(22, 8), want=a, bs=bs, shared=len(shared), replicas=[a, b])
    a.stop_service("scheduler", sig=signal.SIGKILL)                        # A restarts: its cache is empty
    a.start_service("scheduler")
    asyncio.run(generate(b.scheduler_address, shared + [7], "direct-b-2"))
    wait_serving(a.scheduler_address)                                      # A's worker re-attached
    routed(a, shared + prompt(23, 8), want=b, bs=bs, shared=len(shared), replicas=[a, b])
