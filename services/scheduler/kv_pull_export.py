"""KvPullExport: the source side of a cross-replica KV pull (common/kv_pull.py), on replica A.

Another replica's scheduler calls Engine.ExportKvBlocks with the block keys it wants and its worker's receiver.
`export` pins the leading blocks this pool still holds (KVCacheManager.pin_cached: a reference each, so no plan
reuses them: the lease), the next plan carries the send (a PdSend, like a prefill group's: the worker sends after
its forward, a CRC32 per block, and waits for the receiver's answer), the plan's result unpins them and answers the
call. Blocks the pool no longer holds are "no longer have them" (0 sent). A caller that goes away (cancelled,
timed out) leaves its send to finish or fail with its plan; the pin ends with that plan's result either way. A lost
worker fails every export at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from steploop.common.kv_pull import KvExport
from steploop.common.pd_transfer import PdMoves, PdSend
from steploop.common.step_contract import StepPlan, StepResult

if TYPE_CHECKING:
    from steploop.scheduler.engine_loop import EngineLoop
    from steploop.scheduler.kv_cache_manager import KVCacheManager

log = logging.getLogger(__name__)

PIN_PREFIX = "kv-export:"


@dataclass
class _Export:
    transfer_id: str
    destination: str
    kv: KVCacheManager                        # the pool its blocks are pinned in (a new worker brings a new one)
    block_ids: list[int]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def owner(self) -> str:
        return PIN_PREFIX + self.transfer_id


class KvPullExport:
    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine
        self.queue: deque[_Export] = deque()            # pinned, waiting for a plan
        self.in_plan: dict[int, list[_Export]] = {}     # step id -> exports its plan sends
        self.exports = 0                                 # exports answered with blocks sent (metrics)
        self.export_blocks = 0

    async def export(self, transfer_id: str, keys: list[bytes], destination: str, timeout: float) -> KvExport:
        engine = self.engine
        info, sched = engine.worker_info, engine.scheduler
        if info is None or sched is None or engine.group is None:
            return KvExport(0, reason="no worker attached")
        if info.kv_role != "both":
            return KvExport(0, reason="this replica's worker does not send KV blocks (--kv-role both)")
        if not destination or not keys:
            return KvExport(0, reason="nothing asked")
        job = _Export(transfer_id, destination, sched.kv, [])
        if any(j.owner == job.owner for j in self._jobs()):
            return KvExport(0, reason=f"transfer {transfer_id!r} is already being sent")
        job.block_ids = sched.kv.pin_cached(job.owner, keys)
        if not job.block_ids:
            return KvExport(0, reason="no longer cached here")
        self.queue.append(job)
        engine.wake()
        try:
            return await asyncio.wait_for(asyncio.shield(job.done), timeout)
        except asyncio.TimeoutError:
            return KvExport(0, reason=f"not sent within {timeout:g} s")
        finally:
            if job in self.queue:             # never planned (caller gone, timed out): the pin ends now
                self.queue.remove(job)
                self._finish(job, KvExport(0, reason="cancelled"))

    def _jobs(self):
        yield from self.queue
        for jobs in self.in_plan.values():
            yield from jobs

    def has_work(self) -> bool:
        return bool(self.queue or self.in_plan)

    def fill_plan(self, plan: StepPlan) -> None:
        """The queued exports to one destination go in this plan (a plan's sends share one address)."""
        if not self.queue:
            return
        moves = plan.pd_moves or PdMoves()
        if moves.sends and moves.address != self.queue[0].destination:
            return
        destination, taken = self.queue[0].destination, []
        for job in [j for j in self.queue if j.destination == destination]:
            self.queue.remove(job)
            moves.sends.append(PdSend(job.transfer_id, job.block_ids))
            taken.append(job)
        moves.address = destination
        plan.pd_moves = moves
        self.in_plan[plan.step_id] = taken

    def on_result(self, plan: StepPlan, result: StepResult) -> None:
        jobs = self.in_plan.pop(plan.step_id, None)
        if not jobs:
            return
        report = result.pd_report
        sent = set(report.sent) if report is not None else set()
        size = self.engine.worker_info.transfer_block_bytes if self.engine.worker_info is not None else 0
        for job in jobs:
            if job.transfer_id in sent:
                self.exports += 1
                self.export_blocks += len(job.block_ids)
                self._finish(job, KvExport(len(job.block_ids), len(job.block_ids) * size))
            else:
                log.warning("KV export %s to %s failed: %s", job.transfer_id, job.destination,
                            result.error or "the send failed, timed out or was refused")
                self._finish(job, KvExport(0, reason="the send failed, timed out or was refused"))

    def on_worker_lost(self) -> None:
        for job in list(self._jobs()):
            self._finish(job, KvExport(0, reason="the worker was lost"))
        self.queue.clear()
        self.in_plan.clear()

    @staticmethod
    def _finish(job: _Export, answer: KvExport) -> None:
        job.kv.unpin(job.owner)
        if not job.done.done():
            job.done.set_result(answer)
