"""KVCacheManager.fork (beam search's copy on write): full blocks shared by reference count, the partial last block
copied into a block of the child's own, both ends of a copy held until the plan takes it, and every count back
to zero once the tables are freed, in any order."""

from __future__ import annotations

import itertools

import pytest

from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request

BS = 4


def computed(kv: KVCacheManager, rid: str, num_tokens: int, prefix_caching_keys: bool = False) -> Request:
    """A request whose first num_tokens tokens have KV (its table allocated for them)."""
    r = Request(rid, list(range(10, 10 + num_tokens)) + [99])
    assert kv.allocate_slots(r, num_tokens) is not None
    r.num_computed_tokens = num_tokens
    if prefix_caching_keys:
        kv.cache_blocks(r, num_tokens)
    return r


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_blocks_and_copies_the_partial_one(caching):
    kv = KVCacheManager(20, BS, caching)
    parent = computed(kv, "p", 10, prefix_caching_keys=True)      # blocks: full, full, partial (2 of 4)
    table = kv.get_block_ids(parent)
    child = Request("c", parent.prompt_token_ids)
    assert kv.fork(parent, child, "g")
    child_table = kv.get_block_ids(child)
    assert child_table[:2] == table[:2] and child_table[2] not in table
    ref = kv.pool.ref_cnt
    assert [ref[b] for b in table] == [2, 2, 2]        # shared twice; the partial one: parent + the copy's own
    assert ref[child_table[2]] == 2                    # the child + the copy's own
    kv.check_integrity()
    assert kv.take_block_copies() == [(table[2], child_table[2])]
    assert [ref[b] for b in table] == [2, 2, 1] and ref[child_table[2]] == 1
    assert kv.take_block_copies() == []
    kv.check_integrity()


def test_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(20, BS)
    parent = computed(kv, "p", 8, prefix_caching_keys=True)
    child = Request("c", parent.prompt_token_ids)
    free = kv.num_free_blocks
    assert kv.fork(parent, child, "g")
    assert kv.get_block_ids(child) == kv.get_block_ids(parent) and kv.num_free_blocks == free
    assert kv.take_block_copies() == []
    kv.check_integrity()


def test_fork_without_a_free_block_changes_nothing():
    kv = KVCacheManager(4, BS)                          # 3 usable blocks, all the parent's
    parent = computed(kv, "p", 10)
    child = Request("c", parent.prompt_token_ids)
    ref = list(kv.pool.ref_cnt)
    assert not kv.fork(parent, child, "g")
    assert kv.pool.ref_cnt == ref and kv.get_block_ids(child) == [] and kv.take_block_copies() == []
    kv.check_integrity()


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_every_free_order_leaks_nothing(order):
    """A parent, a child and a grandchild (forked before the first copy was taken), freed in every order, before
    and after the copies are taken: all blocks come back."""
    for take_first in (True, False):
        kv = KVCacheManager(30, BS, enable_prefix_caching=False)
        parent = computed(kv, "p", 7)
        child = Request("c", parent.prompt_token_ids)
        assert kv.fork(parent, child, "g")
        child.num_computed_tokens = 7
        grand = Request("gc", parent.prompt_token_ids)
        assert kv.fork(child, grand, "g")
        kv.check_integrity()
        if take_first:
            assert len(kv.take_block_copies()) == 2
        for i in order:
            kv.free([parent, child, grand][i])
            kv.check_integrity()
        kv.take_block_copies()
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_usable_blocks


def test_integrity_catches_sharing_outside_a_group():
    kv = KVCacheManager(20, BS, enable_prefix_caching=False)
    parent = computed(kv, "p", 8)
    other = Request("o", parent.prompt_token_ids)
    kv._tables["o"] = list(kv.get_block_ids(parent))    # shared without fork(): a bug the checker must see
    kv.pool.touch(kv._tables["o"])
    with pytest.raises(AssertionError, match="shared"):
        kv.check_integrity()
    del other
