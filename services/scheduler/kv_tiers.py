"""KvTiers: the KV media below the pool (host memory "CPU", disk "DISK"), as accounted slots the scheduler owns.

Every move is a plan operation (common/kv_moves.py) the worker performs before the step's forward:

* a prefix-cached pool block that the pool reuses (BlockPool's eviction hook) is DEMOTED, not dropped: it is stored
  to a host slot (unless a tier already holds its hash), in the same plan as the reuse; the worker copies it out
  before anything of that step writes the block;
* a host entry that the host LRU evicts goes on to disk (when there is a disk tier and the disk does not hold it);
  the disk LRU drops its oldest file;
* a request being admitted whose prefix continues, past the pool's hits, in host memory gets those blocks LOADED
  into freshly allocated pool blocks, when the step-cost model says the copy is cheaper than recomputing them;
* a prefix that continues on disk is first PROMOTED to host slots (the worker verifies each file's checksum; a miss
  is reported and is a recompute), and the request waits for that step's result, then loads from host. So loads
  into the pool only ever come from memory, and a bad file can never reach the forward.

Preemption swaps through the same path: a preempted request's full blocks are keyed (prefix cache), so when the
pool reuses them they are stored to host, and the request's resume restores them (or recomputes, by cost).

Within one plan a slot is written at most once and an entry the plan writes or reads is pinned (not evicted by the
same plan), so the worker's fixed order (drops, demotes, promotes, stores, loads, forward) reads everything before
it is overwritten. check_move_order() asserts it for every plan in the tests; check() the accounting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from steploop.common.kv_moves import KvMoveReport, KvMoves
from steploop.scheduler.stats import KvTierLoad

MEDIA = ("CPU", "DISK")


class TierIndex:
    """One medium's slots: block hash -> slot, in LRU order (head = least recently used)."""

    def __init__(self, medium: str, capacity: int) -> None:
        self.medium, self.capacity = medium, capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.free: list[int] = list(range(capacity - 1, -1, -1))   # pop() hands out slot 0 first
        self.pinned: set[bytes] = set()      # written or read by the plan being built: not evicted by it
        self.pending: set[bytes] = set()     # promoted from disk, result not back yet: not loadable, not evicted
        self.events = None                   # KvEventRecorder (BlockStored / BlockRemoved with this medium) or None
        self.block_size = 0

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def take_slot(self) -> tuple[int, bytes | None] | None:
        """A free slot, else the least recently used evictable entry's (slot, its hash); None: all pinned."""
        if self.free:
            return self.free.pop(), None
        for key in self.entries:
            if key not in self.pinned and key not in self.pending:
                if self.events is not None:
                    self.events.tier_removed(key, self.medium)
                return self.entries.pop(key), key
        return None

    def insert(self, key: bytes, slot: int) -> None:
        self.entries[key] = slot
        self.pinned.add(key)
        if self.events is not None:
            self.events.tier_stored(key, self.block_size, self.medium)

    def remove(self, key: bytes) -> None:
        if self.events is not None:
            self.events.tier_removed(key, self.medium)
        self.free.append(self.entries.pop(key))
        self.pinned.discard(key)
        self.pending.discard(key)

    def clear(self) -> None:
        events, block_size = self.events, self.block_size
        self.__init__(self.medium, self.capacity)
        self.events, self.block_size = events, block_size

    def check(self) -> None:
        slots = list(self.entries.values())
        assert len(set(slots)) == len(slots), f"{self.medium}: a slot holds two hashes"
        assert not set(slots) & set(self.free), f"{self.medium}: a slot is both free and used"
        assert len(slots) + len(self.free) == self.capacity, (
            f"{self.medium}: {len(slots)} used + {len(self.free)} free != capacity {self.capacity} (leak)")
        assert all(0 <= s < self.capacity for s in slots + self.free), f"{self.medium}: slot out of range"
        assert self.pending <= self.entries.keys(), f"{self.medium}: pending entries not held"


@dataclass
class TierStats:
    """Counters since start, per medium: tokens looked up and found (restored), blocks and bytes moved."""

    queries: int = 0             # tokens looked up in this medium (past the tiers above it)
    hits: int = 0                # of those, tokens restored from it
    blocks_in: int = 0           # blocks written to this medium (stores, demotions, promotions)
    blocks_out: int = 0          # blocks read from it (loads into the pool, promotions, demotions)
    bytes_moved: int = 0         # bytes written to or read from it
    misses: int = 0              # blocks that could not be read back (disk: absent, corrupt, foreign) or written
    restore_seconds: float = 0.0   # worker time of the steps' moves that restored blocks from this medium


class KvTiers:
    def __init__(self, host_blocks: int, disk_blocks: int = 0, block_bytes: int = 0,
                 disk_hashes: Sequence[bytes] = ()) -> None:
        if host_blocks < 1:
            raise ValueError("KV tiers need a host tier (--kv-offloading-size): disk moves go through host memory")
        self.host = TierIndex("CPU", host_blocks)
        self.disk = TierIndex("DISK", disk_blocks) if disk_blocks > 0 else None
        self.block_bytes = block_bytes
        self.stats = {m: TierStats() for m in MEDIA}
        self.moves = KvMoves()                       # of the plan being built
        self.seconds_per_block = 0.0                 # EWMA of the worker's move time per block moved
        self._promoting: dict[str, list[bytes]] = {}  # request id -> hashes promoted for it (it waits for them)
        self.receiving: dict[str, list[bytes]] = {}    # request id -> hashes a P/D transfer fills (pd_disagg.py)
        if self.disk is not None:
            self.index_disk(disk_hashes)

    def attach_events(self, recorder, block_size: int) -> None:
        """Publish every entry in or out of a tier as a KV event with its medium (the router counts hits in any);
        what the tiers already hold (a restarted worker's disk) is published now."""
        for tier in self.tiers:
            tier.events, tier.block_size = recorder, block_size
            for key in tier.entries:
                recorder.tier_stored(key, block_size, tier.medium)

    def index_disk(self, hashes: Sequence[bytes]) -> None:
        """A (restarted) worker's files: the newest `capacity` are indexed, older ones dropped."""
        keep = list(dict.fromkeys(hashes))
        self.moves.disk_drops.extend(keep[:max(len(keep) - self.disk.capacity, 0)])
        for key in keep[-self.disk.capacity:]:
            self.disk.insert(key, self.disk.free.pop())
        self.disk.pinned.clear()

    @property
    def tiers(self) -> list[TierIndex]:
        return [self.host] if self.disk is None else [self.host, self.disk]

    # ---- demotion (BlockPool's eviction hook)
    def demote(self, block_id: int, key: bytes) -> None:
        """The pool reuses keyed block `block_id` in the plan being built: keep its contents below."""
        if key in self.host.entries:
            self.host.touch(key)
            return
        if self.disk is not None and key in self.disk.entries:
            self.disk.touch(key)
            return
        slot = self._host_slot()
        if slot is None:
            return                                   # every host slot is in use by this plan: dropped
        self.host.insert(key, slot)
        self.moves.stores.append((block_id, slot))
        self._count("CPU", blocks_in=1)

    def _host_slot(self) -> int | None:
        got = self.host.take_slot()
        if got is None:
            return None
        slot, victim = got
        # The evicted host entry goes on to disk, unless the disk holds it already (or is all in use by this plan).
        if victim is not None and self.disk is not None and victim not in self.disk.entries:
            disk_slot = self._disk_slot()
            if disk_slot is not None:
                self.disk.insert(victim, disk_slot)
                self.moves.demotes.append((slot, victim))
                self._count("CPU", blocks_out=1)
                self._count("DISK", blocks_in=1)
        return slot

    def _disk_slot(self) -> int | None:
        got = self.disk.take_slot()
        if got is None:
            return None
        slot, victim = got
        if victim is not None:
            self.moves.disk_drops.append(victim)
        return slot

    # ---- restore (admission)
    def restore_for(self, request_id: str, hashes: Sequence[bytes], first: int, max_blocks: int,
                    worth: Callable[[int], bool]) -> list[int] | None:
        """Host slots to load for blocks first, first+1, ... of a request being admitted (maybe []), or None: it
        waits, its disk blocks being promoted to host (issued here, or by an earlier plan still in flight)."""
        promoted = self._promoting.get(request_id)
        if promoted is not None and any(h in self.host.pending for h in promoted):
            return None
        if any(h in self.host.pending for h in self.receiving.get(request_id, ())):
            return None                              # its prompt's blocks are being received into host slots
        slots, i, host = [], first, self.host
        while i < max_blocks and (slot := host.entries.get(hashes[i])) is not None and hashes[i] not in host.pending:
            slots.append(slot)
            i += 1
        host.pinned.update(hashes[first:i])          # not evicted by the stores this admission may cause
        if (promoted is None and self.disk is not None and i < max_blocks and hashes[i] in self.disk.entries
                and (run := self._promote(hashes, i, max_blocks))):
            self._promoting[request_id] = run
            return None
        if slots and not worth(len(slots)):
            return []
        return slots

    def _promote(self, hashes: Sequence[bytes], i: int, max_blocks: int) -> list[bytes]:
        run = []
        while i < max_blocks and hashes[i] in self.disk.entries and hashes[i] not in self.host.entries:
            key = hashes[i]
            self.disk.pinned.add(key)                # the host eviction below may demote to disk: not this one
            slot = self._host_slot()
            if slot is None:
                break
            self.disk.touch(key)
            self.host.insert(key, slot)
            self.host.pending.add(key)
            self.moves.promotes.append((key, slot))
            self._count("DISK", blocks_out=1)
            self._count("CPU", blocks_in=1)
            run.append(key)
            i += 1
        return run

    def load(self, slot: int, block_id: int, key: bytes) -> None:
        self.host.touch(key)
        self.moves.loads.append((slot, block_id))
        self._count("CPU", blocks_out=1)

    def record_admission(self, request_id: str, num_tokens: int, num_pool_hit: int, num_restored: int,
                         block_size: int) -> None:
        """A request was admitted: tokens past the pool's hits were looked up in host memory, some restored
        (those promoted from disk for it count as disk hits)."""
        stats = self.stats["CPU"]
        stats.queries += num_tokens - num_pool_hit
        stats.hits += num_restored
        self.receiving.pop(request_id, None)
        promoted = self._promoting.pop(request_id, None)
        if promoted is not None:
            disk = self.stats["DISK"]
            disk.queries += len(promoted) * block_size
            disk.hits += sum(block_size for h in promoted if h in self.host.entries)

    def forget(self, request_id: str) -> None:
        self._promoting.pop(request_id, None)
        self.receiving.pop(request_id, None)

    # ---- prefill/decode transfers (pd_disagg.py): host slots a transfer is received into, like promotions
    def reserve_receive(self, request_id: str, hashes: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """Host slots for the transfer's blocks 0, 1, ... (stops at the first the host holds already or cannot
        take): (block indexes, slots). They are pending until the receiving plan's result (`on_receive`)."""
        indexes, slots = [], []
        for i, key in enumerate(hashes):
            if key in self.host.entries:
                break
            slot = self._host_slot()
            if slot is None:
                break
            self.host.insert(key, slot)
            self.host.pending.add(key)
            self._count("CPU", blocks_in=1)
            indexes.append(i)
            slots.append(slot)
        self.receiving[request_id] = [hashes[i] for i in indexes]
        return indexes, slots

    def on_receive(self, received: Sequence[tuple[bytes, int]], failed_slots: set[int]) -> int:
        """A receiving plan's result: the (hash, slot) entries it filled become loadable, those it could not
        fill go. Returns how many failed."""
        failed = 0
        for key, slot in received:
            if self.host.entries.get(key) != slot or key not in self.host.pending:
                continue
            if slot in failed_slots:
                self.host.remove(key)
                failed += 1
            else:
                self.host.pending.discard(key)
        return failed

    # ---- the plan and its result
    def take_moves(self) -> KvMoves | None:
        """The moves of the plan just built (None: none); the plan's pins end with it."""
        moves, self.moves = self.moves, KvMoves()
        for tier in self.tiers:
            tier.pinned.clear()
        return moves or None

    def on_result(self, moves: KvMoves, report: KvMoveReport | None, step_failed: bool = False) -> None:
        """The worker performed a plan's moves: promoted entries become loadable, or go if their file missed. A
        failed step without a report may have stopped inside its moves: its promotions count as misses."""
        if report is None and step_failed:
            report = KvMoveReport(failed_promote_slots=[s for _, s in moves.promotes])
        failed = set(report.failed_promote_slots) if report is not None else set()
        for key, slot in moves.promotes:
            if self.host.entries.get(key) != slot or key not in self.host.pending:
                continue
            if slot in failed:
                self.host.remove(key)
                self.stats["DISK"].misses += 1
                if self.disk is not None and key in self.disk.entries:
                    self.disk.remove(key)
                    self.moves.disk_drops.append(key)    # the worker already set the bad file aside; say so
            else:
                self.host.pending.discard(key)
        if report is None:
            return
        for key in report.failed_demote_hashes:
            self.stats["DISK"].misses += 1
            if self.disk is not None and key in self.disk.entries:
                self.disk.remove(key)
        n = len(moves.demotes) + len(moves.promotes) + len(moves.stores) + len(moves.loads)
        if n and report.seconds > 0:
            per_block = report.seconds / n
            self.seconds_per_block = per_block if not self.seconds_per_block else (
                0.8 * self.seconds_per_block + 0.2 * per_block)
        if moves.loads:
            self.stats["CPU"].restore_seconds += report.seconds
        if moves.promotes:
            self.stats["DISK"].restore_seconds += report.seconds

    def reset(self) -> None:
        """The worker is gone: its host memory with it; the disk index comes back from the next worker's hello."""
        for tier in self.tiers:
            tier.clear()
        self.moves = KvMoves()
        self._promoting.clear()
        self.receiving.clear()

    def _count(self, medium: str, blocks_in: int = 0, blocks_out: int = 0) -> None:
        stats = self.stats[medium]
        stats.blocks_in += blocks_in
        stats.blocks_out += blocks_out
        stats.bytes_moved += (blocks_in + blocks_out) * self.block_bytes

    # ---- invariants
    def check(self) -> None:
        for tier in self.tiers:
            tier.check()
            assert not tier.pinned, f"{tier.medium}: pins outlived their plan"
        assert not self.disk or not self.disk.pending, "disk entries are never pending"

    def num_used(self) -> dict[str, int]:
        return {tier.medium: len(tier.entries) for tier in self.tiers}

    def report_load(self, retired: dict[str, TierStats]) -> tuple[KvTierLoad, ...]:
        """Per medium: these tiers' counters plus `retired` (of tiers replaced since start), and blocks held now."""
        out = []
        for tier in self.tiers:
            now, old = self.stats[tier.medium], retired.get(tier.medium, TierStats())
            out.append(KvTierLoad(tier.medium, now.queries + old.queries, now.hits + old.hits,
                                  now.bytes_moved + old.bytes_moved, now.restore_seconds + old.restore_seconds,
                                  now.misses + old.misses, len(tier.entries), tier.capacity))
        return tuple(out)


def retire(into: dict[str, TierStats], tiers: KvTiers | None) -> None:
    """Add the counters of tiers being replaced (a new worker attached) to `into`, so totals stay monotonic."""
    if tiers is None:
        return
    for medium, stats in tiers.stats.items():
        total = into.setdefault(medium, TierStats())
        for name, value in vars(stats).items():
            setattr(total, name, getattr(total, name) + value)


def check_move_order(moves: KvMoves | None) -> None:
    """The worker runs drops, demotes, promotes, stores, loads, then the forward: nothing may be read after the
    same plan overwrote it."""
    if not moves:
        return
    written = [s for _, s in moves.promotes] + [s for _, s in moves.stores]
    assert len(set(written)) == len(written), f"a host slot written twice in one plan: {written}"
    load_slots = [s for s, _ in moves.loads]
    assert not set(load_slots) & {s for _, s in moves.promotes}, "a load reads a slot its plan promotes into"
    # A host entry is evicted only to make room: its slot is rewritten by this plan, after the demotion read it
    # (so a load of that slot reads the new entry, which the worker stores before it loads).
    assert {s for s, _ in moves.demotes} <= set(written), "a slot demoted but not rewritten"
    targets = [b for _, b in moves.loads]
    assert len(set(targets)) == len(targets), "two loads into one pool block"
    assert not set(moves.disk_drops) & {h for h, _ in moves.promotes}, "a promotion reads a file its plan drops"


def restore_is_worth(seconds_per_block: float, cost: tuple[float, float, float] | None, num_blocks: int,
                     block_size: int, context_end: int) -> bool:
    """Copying num_blocks blocks in is cheaper than recomputing their tokens (step-cost model b*tokens + c*pairs);
    until the model has timings, a copy is assumed cheaper (a memcpy against a forward)."""
    if cost is None or seconds_per_block <= 0.0:
        return True
    _, b, c = cost
    tokens = num_blocks * block_size
    recompute = b * tokens + c * tokens * (context_end - (tokens - 1) / 2)
    return num_blocks * seconds_per_block < recompute
