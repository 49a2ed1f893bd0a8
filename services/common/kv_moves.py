"""KV tier moves of one step (steploop.v1.StepPlan kv_* fields) and what the worker says of them (StepResult kv_*).

The scheduler decides every move (scheduler/kv_tiers.py); the worker performs them before the step's forward in
the order of the fields below (gpu_worker/kv_tier_mover.py), each reading what it reads before anything of the
same step overwrites it:

  1. disk_drops      block hashes whose file goes (evicted from the disk tier)
  2. demotes         host slot -> disk file (a host entry evicted to disk; read before step 3/4 rewrite the slot)
  3. promotes        disk file -> host slot (checksum verified; a miss is reported, the slot stays unusable)
  4. stores          pool block -> host slot (a prefix block the pool reuses this step; read before step 5 and the
                     forward write the block)
  5. loads           host slot -> pool block (a restored prefix; written before the forward reads it)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steploop.common.pb.steploop.v1 import worker_pb2


@dataclass
class KvMoves:
    disk_drops: list[bytes] = field(default_factory=list)
    demotes: list[tuple[int, bytes]] = field(default_factory=list)    # (host slot, block hash)
    promotes: list[tuple[bytes, int]] = field(default_factory=list)   # (block hash, host slot)
    stores: list[tuple[int, int]] = field(default_factory=list)       # (pool block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)        # (host slot, pool block)

    def __bool__(self) -> bool:
        return bool(self.disk_drops or self.demotes or self.promotes or self.stores or self.loads)

    def fill_pb(self, pb: worker_pb2.StepPlan) -> None:
        pb.kv_disk_drops.extend(self.disk_drops)
        pb.kv_demote_slots.extend(s for s, _ in self.demotes)
        pb.kv_demote_hashes.extend(h for _, h in self.demotes)
        pb.kv_promote_hashes.extend(h for h, _ in self.promotes)
        pb.kv_promote_slots.extend(s for _, s in self.promotes)
        pb.kv_store_blocks.extend(b for b, _ in self.stores)
        pb.kv_store_slots.extend(s for _, s in self.stores)
        pb.kv_load_slots.extend(s for s, _ in self.loads)
        pb.kv_load_blocks.extend(b for _, b in self.loads)

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepPlan) -> KvMoves | None:
        moves = cls(list(pb.kv_disk_drops), list(zip(pb.kv_demote_slots, pb.kv_demote_hashes)),
                    list(zip(pb.kv_promote_hashes, pb.kv_promote_slots)),
                    list(zip(pb.kv_store_blocks, pb.kv_store_slots)), list(zip(pb.kv_load_slots, pb.kv_load_blocks)))
        return moves or None


@dataclass
class KvMoveReport:
    """The worker's word on a plan's moves: those that failed (the rest completed before the forward)."""

    failed_promote_slots: list[int] = field(default_factory=list)     # disk read missed: the slot holds nothing
    failed_demote_hashes: list[bytes] = field(default_factory=list)   # disk write failed: no such file
    seconds: float = 0.0

    def fill_pb(self, pb: worker_pb2.StepResult) -> None:
        pb.kv_failed_promote_slots.extend(self.failed_promote_slots)
        pb.kv_failed_demote_hashes.extend(self.failed_demote_hashes)
        pb.kv_move_seconds = self.seconds

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepResult) -> KvMoveReport | None:
        if not (pb.kv_failed_promote_slots or pb.kv_failed_demote_hashes or pb.kv_move_seconds):
            return None
        return cls(list(pb.kv_failed_promote_slots), list(pb.kv_failed_demote_hashes), pb.kv_move_seconds)
