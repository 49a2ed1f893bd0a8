"""The router's pull-or-recompute decision (kv_pull_cost.py): a request routed to one replica carries a pull hint
when another replica's pool holds more of its prompt's leading blocks and copying them beats recomputing them."""

from __future__ import annotations

import random

from steploop.common.kv_pull import KvPullHint
from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.kv_pull_cost import KvPullPlanner, KvPullPolicy
from steploop.gateway.routing.router import EngineRouter
from tests.kv_events.helpers import cbor_sha256, expected_chain

BLOCK = 16
P = random.Random(7).sample(range(1000, 40000), 40 * BLOCK + 3)        # 40 full blocks and 3 tokens
KEYS = expected_chain(P, BLOCK, seed="vllm-none-hash")


def snapshot(keys, root=b"") -> engine_pb2.KvEventMessage:
    return engine_pb2.KvEventMessage(snapshot=engine_pb2.KvEventSnapshot(
        instance_id="i", block_hashes=keys, block_size=BLOCK, hash_algo="sha256_cbor",
        hash_root=root or cbor_sha256("vllm-none-hash")))


def stored_on_host(keys, sequence=0) -> engine_pb2.KvEventMessage:
    return engine_pb2.KvEventMessage(batch=engine_pb2.KvEventBatch(sequence=sequence, events=[engine_pb2.KvEvent(
        stored=engine_pb2.KvEventBlockStored(block_hashes=keys, block_size=BLOCK, medium="CPU"))]))


def router(min_tokens: int = 64, enable: bool = True) -> EngineRouter:
    """Three replicas whose channels connect lazily (no I/O here); made inside the running loop, as the gateway does."""
    r = EngineRouter([EngineClient(f"127.0.0.1:{9 + i}") for i in range(3)], block_size=BLOCK,
                     kv_pull=KvPullPolicy(enable, 1.0, min_tokens))
    for replica in r.replicas:
        replica.cache.apply(snapshot([]))
    return r


async def test_the_replica_holding_the_longest_pool_prefix_is_the_source():
    r = router()
    r.replicas[1].cache.apply(snapshot(KEYS[:10]))
    r.replicas[2].cache.apply(snapshot(KEYS[:30]))
    assert r.pull.hint(r.replicas, 0, P, "") == KvPullHint("127.0.0.1:11", 30)


async def test_no_hint_when_off_short_or_already_held():
    r = router(enable=False)
    r.replicas[2].cache.apply(snapshot(KEYS))
    assert r.pull.hint(r.replicas, 0, P, "") is None
    r = router(min_tokens=5 * BLOCK)
    r.replicas[2].cache.apply(snapshot(KEYS[:4]))                     # 64 tokens to gain: under the minimum
    assert r.pull.hint(r.replicas, 0, P, "") is None
    r.replicas[0].cache.apply(snapshot(KEYS[:38]))
    r.replicas[2].cache.apply(snapshot(KEYS))                         # 2 more blocks than the destination holds
    assert r.pull.hint(r.replicas, 0, P, "") is None


async def test_only_the_sources_pool_counts_and_the_destinations_host_tier_does():
    r = router()
    r.replicas[2].cache.apply(stored_on_host(KEYS))                   # in A's host tier only: A cannot send them
    assert r.pull.hint(r.replicas, 0, P, "") is None
    r.replicas[2].cache.apply(snapshot(KEYS[:20]))
    r.replicas[0].cache.apply(stored_on_host(KEYS[:20]))              # B restores those from its own host tier
    assert r.pull.hint(r.replicas, 0, P, "") is None
    assert r.pull.hint(r.replicas, 1, P, "") == KvPullHint("127.0.0.1:11", 20)


async def test_keys_made_another_way_are_not_a_source_and_the_last_block_is_computed():
    r = router()
    r.replicas[2].cache.apply(snapshot(KEYS, root=cbor_sha256("4242")))   # another hash root: not B's keys
    assert r.pull.hint(r.replicas, 0, P, "") is None
    exact = P[:40 * BLOCK]                                                   # ends on a block boundary
    r.replicas[1].cache.apply(snapshot(KEYS))
    assert r.pull.hint(r.replicas, 0, exact, "") == KvPullHint("127.0.0.1:10", 39)


def test_the_estimate_weighs_link_bytes_against_the_measured_prefill_rate():
    planner = KvPullPlanner(KvPullPolicy(True, bandwidth_gbps=1.0, min_tokens=16))
    assert planner.worth(1024, 64)                      # nothing measured: a copy against a forward pass
    planner.block_bytes = 737_280                      # SmolLM2-135M, 16-token blocks, fp32
    planner.observe(2000, 4.0)                         # 500 prompt tokens/s (a CPU)
    assert planner.prefill_rate == 500.0
    assert planner.worth(1024, 64)                     # 47 MB at 1 GB/s ~ 0.05 s against ~2 s
    planner.observe(2000, 0.002)                       # a fast GPU: the rate rises (moving average)
    planner.observe(2000, 0.002)
    assert planner.prefill_rate > 100_000
    slow = KvPullPlanner(KvPullPolicy(True, bandwidth_gbps=0.01, min_tokens=16))
    slow.block_bytes, slow.prefill_rate = 737_280, 20_000.0
    assert not slow.worth(1024, 64)                    # 4.7 s over a 10 MB/s link against 0.05 s of prefill
    assert not planner.worth(8, 1)                     # under --kv-pull-min-tokens
    planner.observe(10, 0.001)                         # too few tokens to be a prefill-rate sample
    assert planner.prefill_rate > 100_000


def test_policy_refuses_bad_values():
    for kwargs, flag in (({"bandwidth_gbps": 0}, "--kv-pull-bandwidth"), ({"min_tokens": 0}, "--kv-pull-min-tokens")):
        try:
            KvPullPolicy(**kwargs)
        except ValueError as err:
            assert flag in str(err)
        else:
            raise AssertionError(f"{kwargs} accepted")


async def test_a_destination_that_never_stored_a_block_still_gets_a_hint():
    r = router()
    r.replicas[0].cache.apply(engine_pb2.KvEventMessage(snapshot=engine_pb2.KvEventSnapshot(
        instance_id="i", hash_algo="sha256_cbor", hash_root=cbor_sha256("vllm-none-hash"))))   # no block size yet
    r.replicas[2].cache.apply(snapshot(KEYS[:12]))
    assert r.pull.hint(r.replicas, 0, P, "") == KvPullHint("127.0.0.1:11", 12)
