"""KV events inside the scheduler: the recorder sees every prefix-cache change (BlockStored per newly keyed run
of full blocks, BlockRemoved on eviction, AllBlocksCleared on reset) and the hub numbers them, snapshots the
cache and replays what a reconnecting watcher missed (Engine.WatchKVEvents' logic, without the transport)."""

from __future__ import annotations

import asyncio

import pytest

from steploop.scheduler.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from steploop.scheduler.kv_events.hub import CacheSnapshot, WatcherCutOff
from tests.kv_events.helpers import expected_chain, make_hub, run_prompt

PROMPT = list(range(1000, 1009))          # 2 full blocks of 4, and 1 token


def test_stored_removed_cleared_in_order():
    hub, kv = make_hub(num_blocks=6, block_size=4)          # 5 usable blocks
    run_prompt(kv, "a", PROMPT)
    stored = hub.flush()
    assert stored.sequence == 0
    assert stored.events == [BlockStored(expected_chain(PROMPT, 4), None, PROMPT[:8], 4)]
    run_prompt(kv, "a-again", PROMPT)                       # a prefix hit stores nothing new
    assert hub.flush() is None
    big = list(range(2000, 2017))                           # 5 blocks: every block, the cached ones too, reused
    run_prompt(kv, "b", big)
    batch = hub.flush()
    removed = [e for e in batch.events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(expected_chain(PROMPT, 4))
    assert batch.events[-1] == BlockStored(expected_chain(big, 4), None, big[:16], 4)
    kv.reset_prefix_cache()
    assert hub.flush().events == [AllBlocksCleared()]
    kv.check_integrity()


def test_a_salted_first_block_carries_its_salt_as_vllm_publishes_it():
    hub, kv = make_hub(num_blocks=6, block_size=4)
    run_prompt(kv, "s", PROMPT, salt="tenant")
    (event,) = hub.flush().events
    assert event.block_hashes == expected_chain(PROMPT, 4, salt="tenant")
    assert event.extra_keys == [("tenant",), None]


async def _take(stream, n):
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(n)]


async def test_watch_starts_from_a_snapshot_then_streams_in_order():
    hub, kv = make_hub(num_blocks=10, block_size=4)
    run_prompt(kv, "a", PROMPT)
    hub.flush()
    stream = hub.watch(0, "")
    (snap,) = await _take(stream, 1)
    assert isinstance(snap, CacheSnapshot) and snap.sequence == 1 and snap.hash_algo == "sha256_cbor"
    assert sorted(snap.block_hashes) == sorted(expected_chain(PROMPT, 4)) and snap.block_size == 4
    other = list(range(3000, 3004))
    run_prompt(kv, "b", other)
    hub.flush()
    (batch,) = await _take(stream, 1)
    assert isinstance(batch, KvEventBatch) and batch.sequence == 1
    assert batch.events[0].block_hashes == expected_chain(other, 4)
    await stream.aclose()


async def test_a_reconnecting_watcher_gets_exactly_what_it_missed():
    hub, kv = make_hub(num_blocks=20, block_size=4)
    for i in range(3):
        run_prompt(kv, f"p{i}", list(range(100 * i, 100 * i + 4)))
        hub.flush()                                          # batches 0, 1, 2
    stream = hub.watch(1, hub.instance_id)                  # it had applied batch 0
    got = await _take(stream, 2)
    assert [b.sequence for b in got] == [1, 2]
    await stream.aclose()
    restarted = hub.watch(1, "another-instance")            # a restarted scheduler's numbers mean nothing here
    (snap,) = await _take(restarted, 1)
    assert isinstance(snap, CacheSnapshot) and len(snap.block_hashes) == 3
    await restarted.aclose()


async def test_a_watcher_too_far_behind_is_cut_off_not_buffered_forever():
    hub, kv = make_hub(num_blocks=40, block_size=4, buffer_steps=2)
    stream = hub.watch(0, "")
    await _take(stream, 1)                                  # the snapshot; then it stops reading
    for i in range(3):
        run_prompt(kv, f"p{i}", list(range(100 * i, 100 * i + 4)))
        hub.flush()
    with pytest.raises(WatcherCutOff):
        await _take(stream, 3)
