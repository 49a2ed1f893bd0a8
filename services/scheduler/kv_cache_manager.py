"""KVCacheManager: the one narrow door to KV memory. The scheduler asks for slots and gets block ids or None.

Each request owns a block table (list of block ids, in token order); block i holds tokens
[i * block_size, (i + 1) * block_size). The pool underneath owns ref counts, the free queue and the prefix-cache
key map. With prefix caching a table may start with blocks shared with other requests (full, keyed, never
written again); every block after them belongs to this request alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from steploop.common.block_hashing import BlockHasher, hash_block
from steploop.common.intmath import cdiv
from steploop.scheduler.block_pool import BlockPool
from steploop.scheduler.kv_tiers import KvTiers
from steploop.scheduler.prefix_cache import PrefixCacheStats, ensure_block_hashes
from steploop.scheduler.request import Request

if TYPE_CHECKING:   # the recorder is passed in (engine_loop.py)
    from steploop.scheduler.kv_events.recorder import KvEventRecorder


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hasher: BlockHasher = hash_block, events: KvEventRecorder | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher
        self.events = events                       # None: KV events off (nothing recorded, no cost)
        self.pool = BlockPool(num_blocks, events)
        self.prefix_cache_stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}   # request_id -> block ids, in token order
        self._num_cached: dict[str, int] = {}     # request_id -> leading blocks of its table already keyed
        self.tiers: KvTiers | None = None         # KV media below the pool (kv_tiers.py); None = none
        # Beams (beam_groups.py): request_id -> its beam group's id, for every table that fork() made or forked
        # from; blocks shared inside one group need not be keyed. And the block copies (source, destination)
        # the next plan carries: each end holds one reference of its own until take_block_copies().
        self._group_of: dict[str, str] = {}
        self._copies: list[tuple[int, int]] = []
        self._pins: dict[str, list[int]] = {}     # a cross-replica pull's send (kv_pull_export.py) -> blocks it reads

    def attach_tiers(self, tiers: KvTiers | None) -> None:
        """Use these tiers below the pool (None: none). They key blocks by prefix hash, so without prefix
        caching they are not used."""
        self.tiers = tiers if self.enable_prefix_caching else None
        self.pool.on_evict = self.tiers.demote if self.tiers is not None else None

    # ---- the questions callers ask
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool as the worker reported them, the null block 0 included."""
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold: all but the null block."""
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def can_fit(self, num_tokens: int) -> bool:
        """Could one sequence of num_tokens tokens ever fit the pool (every block free)?"""
        return cdiv(num_tokens, self.block_size) <= self.num_usable_blocks

    def num_blocks_to_admit(self, request: Request, max_new_tokens: int) -> int:
        """Free blocks that admitting the waiting `request` with up to max_new_tokens tokens in its first step
        would take: allocate_slots' arithmetic, its longest cached prefix reused."""
        hits, num_hit = self.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, max_new_tokens)
        return self._num_free_blocks_taken(cdiv(num_hit + num_new, self.block_size) - len(hits), hits)

    def num_blocks_to_hold(self, request: Request, hits: Sequence[int]) -> int:
        """Free blocks the waiting `request` would take to hold its whole context (every token it has, prompt and
        any outputs of a preempted request), its prefix-cache `hits` reused: admission asks for these up front."""
        return self._num_free_blocks_taken(cdiv(request.num_tokens, self.block_size) - len(hits), hits)

    def num_blocks_promised(self, requests: Sequence[Request]) -> int:
        """Free blocks the running `requests` will still take for what admission promised them: the rest of each
        one's context (a prompt still in chunks) and its next token (none for an embedding request)."""
        tables, block_size, n = self._tables, self.block_size, 0
        for r in requests:
            tokens = max(r.num_tokens + r.num_output_placeholders, r.num_computed_tokens) + (r.pooling is None)
            n += max(0, cdiv(tokens, block_size) - len(tables.get(r.request_id, ())))
        return n

    def num_blocks_freed_in_turn(self, requests: Sequence[Request]) -> list[int]:
        """If `requests` were freed one after another: after each, how many blocks in all would have gone back
        to the free queue (a block shared among them counts once its last holder is freed)."""
        ref_cnt, dropped, freed, out = self.pool.ref_cnt, Counter(), 0, []
        for request in requests:
            for block_id in self.get_block_ids(request):
                dropped[block_id] += 1
                freed += dropped[block_id] == ref_cnt[block_id]
            out.append(freed)
        return out

    def num_blocks_held_alone(self, requests: Sequence[Request]) -> int:
        """Blocks of these requests that no other request shares (ref count 1)."""
        ref_cnt = self.pool.ref_cnt
        return sum(1 for r in requests for b in self.get_block_ids(r) if ref_cnt[b] == 1)

    def _num_free_blocks_taken(self, num_new_blocks: int, computed_blocks: Sequence[int]) -> int:
        # New blocks come from the free queue, and so does any hit that sits there (ref count 0): touching it
        # takes it out.
        ref_cnt = self.pool.ref_cnt
        return max(num_new_blocks, 0) + sum(1 for b in computed_blocks if ref_cnt[b] == 0)

    def get_block_ids(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    # ---- prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's full blocks: (block ids, tokens they hold). No side effect
        on the pool. Never the whole sequence: the last token is always computed, to have logits to sample.
        A request that asks for prompt logprobs takes no hits (as vLLM): every prompt position needs its logits;
        nor does an embedding request pooled over every position (MEAN, CLS: Request.no_prefix_hits)."""
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs >= 0 or request.no_prefix_hits:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in ensure_block_hashes(request, max_blocks, self.block_size, self.hasher)[:max_blocks]:
            block_id = self.pool.get_cached_block(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Key every block of the request that is full within its first num_tokens tokens (KV written)."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        rid = request.request_id
        done = self._num_cached.get(rid, 0)
        if num_full <= done:
            return                                # the decode fast path: nothing new filled
        table = self._tables[rid]
        num_full = min(num_full, len(table))
        hashes = ensure_block_hashes(request, num_full, self.block_size, self.hasher)
        keyed = [i for i in range(done, num_full) if self.pool.cache_block(table[i], hashes[i])]
        self._num_cached[rid] = num_full
        if self.events is not None and keyed:
            self.events.stored(request, keyed, hashes, self.block_size)

    def reset_prefix_cache(self) -> None:
        """Drop every key (the worker that held the KV is gone); held and free blocks are otherwise unchanged."""
        self.pool.reset_prefix_cache()
        if self.tiers is not None:
            self.tiers.reset()
        self._num_cached = {rid: 0 for rid in self._num_cached}
        self.prefix_cache_stats.resets += 1

    # ---- slots
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                       reserve: int = 0, restored: Sequence[int] = ()) -> list[int] | None:
        """Make room for request.num_computed_tokens + num_new_tokens tokens.

        `computed_blocks` are prefix-cache hits for a request being admitted (its table is empty and
        num_computed_tokens already counts them); they are shared, not copied. `reserve` blocks must stay free
        afterwards (the admission watermark). `restored` are host-tier slots of the blocks right after the hits
        (num_computed_tokens counts them too): each gets a new block, loaded before the forward (kv_tiers.py),
        keyed as a prefix hit would be. Returns the block ids appended to the table after the hits (maybe
        []), or None when the pool lacks free blocks; then nothing is allocated, so the caller can preempt and
        retry.

        A table always covers the request's num_computed_tokens, so one more token for a request whose
        num_computed_tokens is not a multiple of block_size always fits its last block (returns []): a caller
        on a hot path may skip that call (the scheduler's decode loop does).
        """
        rid = request.request_id
        table = self._tables.get(rid)
        have = len(table) if table is not None else 0
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - have
        if needed <= 0 and not computed_blocks:
            return []                             # the decode fast path: room left in its last block
        needed -= len(computed_blocks)
        taken = self._num_free_blocks_taken(needed, computed_blocks) if computed_blocks else needed
        if taken + reserve > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._tables[rid] = []
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            self._num_cached[rid] = len(computed_blocks)
        new_ids = self.pool.get_new_blocks(needed) if needed > 0 else []
        table.extend(new_ids)
        if restored:
            self._restore(request, len(computed_blocks), restored, new_ids[:len(restored)])
        return new_ids

    def _restore(self, request: Request, first: int, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        hashes = request.block_hashes
        keyed = []
        for i, (slot, block_id) in enumerate(zip(slots, block_ids), first):
            self.tiers.load(slot, block_id, hashes[i])
            if self.pool.cache_block(block_id, hashes[i]):
                keyed.append(i)
        self._num_cached[request.request_id] = first + len(slots)
        if self.events is not None and keyed:
            self.events.stored(request, keyed, hashes, self.block_size)

    def free(self, request: Request) -> None:
        """Give back every block of the request (idempotent). Tail blocks first, see BlockPool.free_blocks."""
        table = self._tables.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self._group_of.pop(request.request_id, None)
        self.pool.free_blocks(reversed(table))

    # ---- cross-replica pulls: blocks another replica's worker is being sent (kv_pull_export.py)
    def pin_cached(self, owner: str, keys: Sequence[bytes]) -> list[int]:
        """Holds the pool blocks of the leading `keys` the prefix cache holds (a reference each, so no plan reuses
        them) until unpin(owner): the source side's lease while its worker sends them. [] when the first is gone."""
        ids = []
        for key in keys:
            block_id = self.pool.get_cached_block(key)
            if block_id is None:
                break
            ids.append(block_id)
        if ids:
            self.pool.touch(ids)
            self._pins[owner] = ids
        return ids

    def unpin(self, owner: str) -> None:
        self.pool.free_blocks(reversed(self._pins.pop(owner, [])))

    # ---- beams: fork with copy on write
    def fork(self, parent: Request, child: Request, group_id: str) -> bool:
        """Give `child` (no table yet) the KV of the parent's first parent.num_computed_tokens tokens: the full
        blocks shared (one more reference each), and the partial last block, which the child will write next,
        copied into a new block of its own (copy on write; the copy is in the next plan, take_block_copies).
        False when that block cannot be had (nothing changed): the caller recomputes the child instead.

        ```
          parent  [A][B][c.]        A, B full (shared: ref +1)   c partial (3 of 4 slots written)
          child   [A][B][c']        c' new, filled from c before the next forward; the child writes slot 4
        ```
        """
        table = self._tables[parent.request_id]
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            return False
        shared = table[:num_full]
        self.pool.touch(shared)
        child_table = self._tables[child.request_id] = list(shared)
        if partial:
            src, (dst,) = table[num_full], self.pool.get_new_blocks(1)
            child_table.append(dst)
            self.pool.touch((src, dst))      # the copy's own references: neither block is reused before it
            self._copies.append((src, dst))
        self._num_cached[child.request_id] = min(self._num_cached.get(parent.request_id, 0), num_full)
        self._group_of[parent.request_id] = self._group_of[child.request_id] = group_id
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copies fork() made since the last call, for the plan being built; their own references go (the
        plan is complete, so no block it allocates can be one of them)."""
        copies, self._copies = self._copies, []
        for src, dst in copies:
            self.pool.free_blocks((src, dst))
        return copies

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the number of tables holding it; shared blocks
        are keyed (only prefix-cache hits are ever shared)."""
        self.pool.check_integrity()
        owners = Counter(b for table in self._tables.values() for b in table)
        owners.update(b for copy in self._copies for b in copy)    # a pending copy holds both its blocks
        owners.update(b for pin in self._pins.values() for b in pin)   # so does a pull's send
        groups: dict[int, set[str | None]] = {}
        for rid, table in self._tables.items():
            for block_id in table:
                groups.setdefault(block_id, set()).add(self._group_of.get(rid))
        for block_id, n in owners.items():
            assert self.pool.ref_cnt[block_id] == n, (
                f"block {block_id}: held by {n} tables and copies but ref_cnt={self.pool.ref_cnt[block_id]}")
            one_group = None not in groups.get(block_id, {None}) and len(groups[block_id]) == 1
            assert n == 1 or block_id in self.pool.block_hash or one_group or block_id not in groups, (
                f"block {block_id} is shared by {n} tables but holds no cached prefix")
        held = sum(1 for r in self.pool.ref_cnt if r > 0)
        assert held == len(owners), f"{held} blocks have ref_cnt > 0 but tables hold {len(owners)}"
        if not self.enable_prefix_caching:     # then only one beam group's tables (and copies) share a block
            assert not self.pool.block_hash, "blocks keyed with prefix caching off"
        assert set(self._group_of) <= set(self._tables), "beam group entries without a table"
        for rid, n in self._num_cached.items():
            assert n <= len(self._tables.get(rid, ())), f"{rid}: {n} cached blocks beyond its table"
        if self.tiers is not None:
            self.tiers.check()

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)
