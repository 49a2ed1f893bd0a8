"""KVCacheManager: the one narrow door to KV memory. The scheduler asks for slots and gets block ids or None.

Each request owns a block table (list of block ids, in token order); block i holds tokens
[i * block_size, (i + 1) * block_size). The pool underneath owns ref counts and the free queue.
"""

from __future__ import annotations

from collections import Counter

from services.scheduler.block_pool import BlockPool
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}   # request_id -> block ids, in token order

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def can_fit(self, num_tokens: int) -> bool:
        """Could one sequence of num_tokens tokens ever fit the pool (every block free)?"""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks - 1

    def get_block_ids(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for request.num_computed_tokens + num_new_tokens tokens.

        Returns the block ids appended to the request's table (maybe []), or None when the pool lacks free
        blocks; then nothing is allocated (never partially), so the caller can preempt and retry.
        """
        table = self._tables.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            if not table:
                del self._tables[request.request_id]
            return None
        new_ids = self.pool.get_new_blocks(needed)
        table.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Give back every block of the request (idempotent). Tail blocks first, see BlockPool.free_blocks."""
        table = self._tables.pop(request.request_id, [])
        self.pool.free_blocks(reversed(table))

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the number of tables holding it."""
        self.pool.check_integrity()
        owners = Counter(b for table in self._tables.values() for b in table)
        for block_id, n in owners.items():
            assert self.pool.ref_cnt[block_id] == n, (
                f"block {block_id}: held by {n} tables but ref_cnt={self.pool.ref_cnt[block_id]}")
        held = sum(1 for r in self.pool.ref_cnt if r > 0)
        assert held == len(owners), f"{held} blocks have ref_cnt > 0 but tables hold {len(owners)}"
        # Without prefix caching no block may be shared between requests.
        assert all(n == 1 for n in owners.values()), f"blocks shared: {[b for b, n in owners.items() if n > 1]}"

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)
