"""TieredFakeWorker: a FakeWorker that keeps the CONTENTS of its KV pool, host slots and disk files, performs a plan's
tier moves in the worker's order (kv_moves.py), and before each forward checks that every position a scheduled
request attends to holds that request's own KV. A move out of order, a load from the wrong slot, a block reused
before its store or read before its load: each shows up as a KV mismatch here, not as a lucky token.

A position's "KV" is a fingerprint of the tokens up to and including it (as a real model's K/V depend on the whole
prefix), so a block with the right tokens from another prefix does not pass either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sched_factories import FakeWorker

from steploop.common.kv_moves import KvMoveReport
from steploop.common.step_contract import StepPlan, StepResult

Block = tuple  # one fingerprint (or None) per token position of the block


def fingerprints(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        out.append(h)
    return out


@dataclass
class TieredFakeWorker(FakeWorker):
    pool: dict[int, list] = field(default_factory=dict)        # block id -> fingerprints per position
    host: dict[int, list] = field(default_factory=dict)        # host slot -> a block's contents
    disk: dict[bytes, list] = field(default_factory=dict)      # block hash -> a block's contents
    corrupt: set[bytes] = field(default_factory=set)           # files that fail their checksum when read
    disk_full: bool = False                                    # every disk write fails (disk full)
    moves_seen: int = 0

    def execute(self, plan: StepPlan) -> StepResult:
        report = self._move(plan) if plan.kv_moves else None
        result = super().execute(plan)
        result.kv_moves = report
        return result

    def _move(self, plan: StepPlan) -> KvMoveReport:
        moves, report = plan.kv_moves, KvMoveReport(seconds=1e-4)
        self.moves_seen += 1
        for key in moves.disk_drops:
            self.disk.pop(key, None)
            self.corrupt.discard(key)
        for slot, key in moves.demotes:
            assert slot in self.host, f"demote of empty host slot {slot}"
            if self.disk_full:
                report.failed_demote_hashes.append(key)
            else:
                self.disk[key] = list(self.host[slot])
                self.corrupt.discard(key)
        for key, slot in moves.promotes:
            if key in self.disk and key not in self.corrupt:
                self.host[slot] = list(self.disk[key])
            else:                                   # a miss: the slot holds nothing usable
                self.host[slot] = ["garbage"] * self.block_size
                self.disk.pop(key, None)            # the real worker sets a bad file aside
                self.corrupt.discard(key)
                report.failed_promote_slots.append(slot)
        for block_id, slot in moves.stores:
            assert block_id in self.pool, f"store of never-written pool block {block_id}"
            self.host[slot] = list(self.pool[block_id])
        for slot, block_id in moves.loads:
            assert slot in self.host, f"load from empty host slot {slot}"
            self.pool[block_id] = list(self.host[slot])
        return report

    def _run(self, plan: StepPlan) -> dict[int, list[int]]:
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            if handle in self.failed:
                continue
            held = self.held[handle]
            known = held.tokens + plan.draft_token_ids.get(handle, [])
            want = fingerprints(known[:held.num_computed + n])
            self._check_attended(handle, held, want)
            for pos in range(held.num_computed, held.num_computed + n):   # the forward writes its tokens' KV
                block = self.pool.setdefault(held.block_ids[pos // self.block_size], [None] * self.block_size)
                block[pos % self.block_size] = want[pos]
        return super()._run(plan)

    def _check_attended(self, handle: int, held, want: list[int]) -> None:
        for pos in range(held.num_computed):
            block_id = held.block_ids[pos // self.block_size]
            got = self.pool.get(block_id, [None] * self.block_size)[pos % self.block_size]
            assert got == want[pos], (f"handle {handle}: position {pos} (block {block_id}) holds KV of another "
                                      f"prefix")
