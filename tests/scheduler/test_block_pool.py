"""BlockPool and KVCacheManager: null block, LRU free queue, all-or-nothing allocation, integrity checks."""

from __future__ import annotations

import pytest

from services.scheduler.block_pool import NULL_BLOCK_ID, BlockPool
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request


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
