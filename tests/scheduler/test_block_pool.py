"""BlockPool and KVCacheManager: null block, LRU free queue, all-or-nothing allocation, integrity checks."""

from __future__ import annotations

import pytest

from steploop.scheduler.block_pool import NULL_BLOCK_ID, BlockPool
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    ids = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in ids and sorted(ids) == [1, 2, 3, 4]
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([NULL_BLOCK_ID])                  # padding entries are ignored
    pool.check_integrity()


def test_free_queue_is_lru():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)                         # 1, 2, 3
    pool.free_blocks([a[1]])
    pool.free_blocks([a[0]])
    # 4 and 5 were never used, then 2, then 1: reuse the longest-free first.
    assert pool.get_new_blocks(4) == [4, 5, a[1], a[0]]
    pool.check_integrity()


def test_ref_counts_and_double_free():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.ref_cnt[b] += 1                                # a second holder (prefix sharing, later)
    pool.free_blocks([b])
    assert pool.num_free_blocks == 1                    # still held once
    pool.free_blocks([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_check_integrity_reports_corruption():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.ref_cnt[b] = 0                                 # held by nobody, yet not free
    with pytest.raises(AssertionError, match=f"block {b}: ref_cnt=0 but in_free_queue=False"):
        pool.check_integrity()


def test_allocate_slots_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=4)     # 4 usable blocks = 16 tokens
    a, b = Request("a", [1] * 10), Request("b", [1] * 10)
    assert kv.allocate_slots(a, 10) == [1, 2, 3]
    assert kv.allocate_slots(b, 10) is None             # needs 3, 1 free: nothing taken
    assert kv.num_free_blocks == 1 and kv.get_block_ids(b) == []
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == []                # still inside block 3
    assert kv.allocate_slots(a, 3) == [4]
    kv.check_integrity()
    kv.free(a)
    kv.free(a)                                          # idempotent
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    kv.check_integrity()


def test_can_fit():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.can_fit(16) and not kv.can_fit(17)


def test_manager_answers_what_callers_ask():
    kv = KVCacheManager(num_blocks=9, block_size=4)     # 8 usable blocks
    assert (kv.num_blocks, kv.num_usable_blocks, kv.num_free_blocks) == (9, 8, 8)
    a = Request("a", list(range(10, 22)))               # 12 tokens = 3 full blocks
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_blocks(a, 12)
    kv.free(a)                                          # its blocks stay keyed in the free queue
    b = Request("b", list(range(10, 22)) + [5, 6, 7])   # 15 tokens: hits on a's first 3 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    # 4 blocks for 15 tokens: 3 hits (free, so each takes a free block when touched) + 1 new.
    assert kv.num_blocks_to_admit(b, max_new_tokens=64) == 4
    assert kv.num_blocks_to_admit(b, max_new_tokens=1) == 4
    free_before = kv.num_free_blocks
    b.num_computed_tokens = num_hit
    assert kv.allocate_slots(b, 3, hits) is not None
    assert free_before - kv.num_free_blocks == 4        # what num_blocks_to_admit said
    c = Request("c", list(range(10, 22)) + [8])         # shares b's first 3 blocks
    hits, num_hit = kv.get_computed_blocks(c)
    c.num_computed_tokens = num_hit
    kv.allocate_slots(c, 1, hits)
    assert kv.num_blocks_to_admit(Request("d", list(range(10, 22)) + [9]), max_new_tokens=64) == 1
    # b and c share 3 blocks and own 1 each: freeing b frees 1, then c frees its own 1 + the 3 shared.
    assert kv.num_blocks_held_alone([b, c]) == 2
    assert kv.num_blocks_freed_in_turn([b, c]) == [1, 5]
    assert kv.num_free_blocks == 3                      # asking changed nothing
    kv.check_integrity()
