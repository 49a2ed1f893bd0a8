"""The router routes by what each replica's KV events say it caches (kv_index.py), over its own guess: the
replica that really holds the prefix wins, a cleared cache stops attracting requests, and prompts are hashed
with the replica's own function and root (a seed that differs from the gateway's still matches)."""

from __future__ import annotations

import random

from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.router import EngineRouter
from tests.kv_events.helpers import cbor_sha256, expected_chain

BLOCK = 16


def prompt(seed: int, n: int = 128) -> list[int]:
    return random.Random(seed).sample(range(1000, 40000), n)


def snapshot(keys, root=b"", instance="i", sequence=0) -> engine_pb2.KvEventMessage:
    return engine_pb2.KvEventMessage(snapshot=engine_pb2.KvEventSnapshot(
        instance_id=instance, sequence=sequence, block_hashes=keys, block_size=BLOCK, hash_algo="sha256_cbor",
        hash_root=root or cbor_sha256("vllm-none-hash")))


def make_router(n: int = 3) -> EngineRouter:
    # Channels connect lazily: routing decisions here do no I/O.
    return EngineRouter([EngineClient(f"127.0.0.1:{9 + i}") for i in range(n)], block_size=BLOCK)


async def test_the_replica_whose_cache_holds_the_prefix_wins_over_the_guess():
    router = make_router()
    p = prompt(1)
    router.affinity.record(router.affinity.block_hashes(p), 0)            # the guess: replica 0
    for replica in router.replicas:
        replica.cache.apply(snapshot([]))
    router.replicas[2].cache.apply(snapshot(expected_chain(p, BLOCK, seed="vllm-none-hash")[:6]))
    order, matched, source = router.route(p)
    assert (order[0], matched, source) == (2, 6 * BLOCK, "events")


async def test_a_cleared_cache_no_longer_attracts_and_the_guess_is_the_fallback():
    router = make_router()
    p = prompt(2)
    keys = expected_chain(p, BLOCK, seed="vllm-none-hash")
    for replica in router.replicas:
        replica.cache.apply(snapshot([]))
    router.replicas[1].cache.apply(snapshot(keys))
    assert router.route(p)[0][0] == 1                                    # recorded in the guess map too
    router.replicas[1].cache.apply(engine_pb2.KvEventMessage(batch=engine_pb2.KvEventBatch(
        sequence=0, events=[engine_pb2.KvEvent(cleared=engine_pb2.KvEventAllBlocksCleared())])))
    router.replicas[0].cache.apply(engine_pb2.KvEventMessage(batch=engine_pb2.KvEventBatch(
        sequence=0, events=[engine_pb2.KvEvent(stored=engine_pb2.KvEventBlockStored(
            block_hashes=keys[:4], token_ids=p[:64], block_size=BLOCK))])))
    order, matched, source = router.route(p)
    assert (order[0], matched, source) == (0, 4 * BLOCK, "events")
    router.replicas[0].cache.apply(engine_pb2.KvEventMessage(batch=engine_pb2.KvEventBatch(
        sequence=1, events=[engine_pb2.KvEvent(removed=engine_pb2.KvEventBlockRemoved(block_hashes=keys[:4]))])))
    order, _, source = router.route(p)                                   # nobody holds it: the guess (in flight?)
    assert source == "guess" and order[0] == 0


async def test_prompts_are_hashed_with_the_replicas_own_root():
    router = make_router(2)
    p = prompt(3)
    root = cbor_sha256("4242")                       # that replica runs with PYTHONHASHSEED=4242, the gateway not
    router.replicas[0].cache.apply(snapshot([]))
    router.replicas[1].cache.apply(snapshot(expected_chain(p, BLOCK, seed="4242"), root=root))
    assert router.route(p)[:2] == ([1, 0], len(p) // BLOCK * BLOCK)


async def test_out_of_order_batches_are_refused():
    router = make_router(1)
    cache = router.replicas[0].cache
    cache.apply(snapshot([], sequence=5))
    try:
        cache.apply(engine_pb2.KvEventMessage(batch=engine_pb2.KvEventBatch(sequence=7)))
    except ValueError as err:
        assert "out of order" in str(err)
    else:
        raise AssertionError("a gap was applied")
