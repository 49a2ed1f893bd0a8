"""BlockPool: every KV block of the worker's cache, who holds it, and which are free (in LRU order).

```
 block id:   0      1     2     3     4     5     6     7
           [null] [ 2 ] [ 0 ] [ 1 ] [ 0 ] [ 0 ] [ 1 ] [ 0 ]      ref_cnt per block
              │            │           │     │           │
              │            └───────────┼─────┼───────────┼──▶ free queue (OrderedDict, O(1) both ends
              │                        │     │           │    and O(1) removal from the middle):
              │              head ─▶ [ 2 ] [ 4 ] [ 5 ] [ 7 ] ◀─ tail
              │                       evict/reuse first     freed last
              └─ never handed out, never freed: a padding target for block tables.

 Invariants (check_integrity):
   * block 0 is never free and never held (ref_cnt stays 0);
   * every other block is EITHER in the free queue (ref_cnt == 0) OR held (ref_cnt > 0), never both;
   * len(free queue) + #held == num_blocks - 1.
```

Prefix caching: a full block gets a key (`block_hash[id]`, and `_cached[key] = id`). A freed keyed block stays in
the free queue, still keyed, so a later request can `touch()` it (ref_cnt 0 -> 1 takes it out of the middle of
the queue, O(1)). `get_new_blocks` takes from the head, the least recently freed, and only then drops the key of
the block it reuses (lazy eviction). A cached-but-free block counts as free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the recorder is passed in; the pool itself imports nothing of KV events
    from steploop.scheduler.kv_events.recorder import KvEventRecorder

NULL_BLOCK_ID = 0


class BlockPool:
    def __init__(self, num_blocks: int, events: KvEventRecorder | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the reserved null block)")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # Insertion order is LRU order: head = freed longest ago = reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.block_hash: dict[int, bytes] = {}   # block id -> prefix-cache key of its (full) contents
        self._cached: dict[bytes, int] = {}      # prefix-cache key -> block id (one block per key)
        self.events = events                     # KV events (BlockRemoved, AllBlocksCleared); None = off
        # Called with (block id, key) when a keyed block is reused: KV tiers demote it (kv_tiers.py); None = off.
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (null excluded) that are held, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue, each with ref_cnt 1. All or nothing."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} blocks: only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict_hash(block_id)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        return ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 goes to the tail of the free queue.

        Callers pass a request's blocks in reverse table order, so that a request's tail blocks (least likely
        to be shared as a prefix) are reused before its head blocks.
        """
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def _evict_hash(self, block_id: int) -> None:
        # Reusing a block overwrites its KV, so its prefix-cache entry (if any) must go.
        key = self.block_hash.pop(block_id, None)
        if key is not None:
            del self._cached[key]
            if self.on_evict is not None:
                self.on_evict(block_id, key)
            if self.events is not None:
                self.events.removed(key)

    # ---- prefix cache
    def get_cached_block(self, key: bytes) -> int | None:
        return self._cached.get(key)

    def cache_block(self, block_id: int, key: bytes) -> bool:
        """Register a held, full block under its key; True if it was keyed. If another block already holds the
        same contents (two requests computed one prefix at once) the first keeps the key and this one stays
        unkeyed."""
        if key not in self._cached and block_id not in self.block_hash:
            self._cached[key] = block_id
            self.block_hash[block_id] = key
            return True
        return False

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each (cached) block; a free one leaves the free queue."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def reset_prefix_cache(self) -> None:
        """Forget every key (a new worker's KV cache is empty); the blocks stay where they are."""
        self.block_hash.clear()
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()

    def check_integrity(self) -> None:
        assert NULL_BLOCK_ID not in self._free, "null block 0 is in the free queue"
        assert self.ref_cnt[NULL_BLOCK_ID] == 0, f"null block 0 has ref_cnt {self.ref_cnt[NULL_BLOCK_ID]}"
        held = 0
        for block_id in range(1, self.num_blocks):
            ref, free = self.ref_cnt[block_id], block_id in self._free
            assert ref >= 0, f"block {block_id} has negative ref_cnt {ref}"
            assert free != (ref > 0), f"block {block_id}: ref_cnt={ref} but in_free_queue={free}"
            held += ref > 0
        assert len(self._free) + held == self.num_blocks - 1, (
            f"free={len(self._free)} + held={held} != num_blocks-1={self.num_blocks - 1}")
        assert len(self._cached) == len(self.block_hash), "key maps disagree"
        for key, block_id in self._cached.items():
            assert self.block_hash.get(block_id) == key, f"block {block_id}: key map and block map disagree"
