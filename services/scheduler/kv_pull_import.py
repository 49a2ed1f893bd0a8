"""KvPullImport: the receiving side of a cross-replica KV pull (common/kv_pull.py), on replica B.

A request that arrives with a KvPullHint is held here (not queued) while its prompt's leading blocks are fetched:

  1. `start` keys the hinted blocks (the same chained hash as A's, the router checked), skips those B's pool or
     host tier holds already, and calls A's Engine.ExportKvBlocks(keys, B's worker receiver) in a task;
  2. A pins what it still holds, its worker sends them to B's worker (a CRC32 per block, staged there) and A answers
     how many leading blocks were acknowledged;
  3. `admit_ready` (before B's next plan) reserves host slots for those blocks, the plan receives them into the
     slots (checksums checked again) and the request joins the queue in the same plan; its admission restores
     them as a host-tier prefix once the result says they landed (kv_tiers.restore_for waits for it), so only the
     rest of the prompt is computed.

Every failure is a recompute of those tokens, counted in `failures`, never a wrong token: A unreachable or gone,
blocks evicted there, a send that failed, timed out or was refused for a checksum, a receive that could not fill a
slot. An abort frees both ends: the call to A is cancelled (A unpins once its plan is answered), a transfer
already staged here is discarded by the next plan (one that lands later is dropped by the receiver's lease).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from steploop.common import grpc_options, tls, tracing
from steploop.common.kv_pull import KvExport, KvPullHint
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.common.pd_transfer import PdMoves, PdReceive
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler import tracing as request_tracing
from steploop.scheduler.prefix_cache import ensure_block_hashes
from steploop.scheduler.request import Request

if TYPE_CHECKING:
    from steploop.scheduler.engine_loop import EngineLoop

log = logging.getLogger(__name__)


@dataclass
class KvPullStats:
    """Counters since start (the steploop:kv_pull_* metrics)."""

    pulls: int = 0               # hinted requests that asked the source replica for blocks
    pulled: int = 0              # of them, those whose blocks arrived (every checksum verified)
    blocks: int = 0              # blocks received
    bytes: int = 0
    failures: int = 0            # pulls that fell back to recomputing (source gone, evicted, send or receive failed)
    seconds: float = 0.0         # time from asking the source to its answer, summed
    exports: int = 0             # this replica as the source: exports sent and acknowledged
    export_blocks: int = 0


@dataclass
class _Pull:
    request: Request
    hint: KvPullHint
    keys: list[bytes]                     # the blocks asked for: the prompt's blocks first, first+1, ...
    transfer_id: str = field(default_factory=lambda: f"pull-{uuid.uuid4().hex}")
    task: asyncio.Task | None = None
    answer: KvExport | None = None


class KvPullImport:
    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine
        self.jobs: dict[str, _Pull] = {}                 # asking the source
        self.ready: deque[_Pull] = deque()               # answered: admitted with the next plan
        self.discards: list[str] = []                    # transfers staged on the worker no request will use
        self.receiving: dict[int, list[tuple[str, bytes, int]]] = {}   # step id -> (request id, key, host slot)
        self.stats = KvPullStats()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._moves: PdMoves | None = None
        self._received: list[tuple[str, bytes, int]] = []

    # ---- per request
    def usable(self) -> str:
        """"" when this replica can receive pulled blocks, else why not."""
        info, sched = self.engine.worker_info, self.engine.scheduler
        if info is None or sched is None or self.engine.group is None:
            return "no worker attached"
        if info.kv_role != "both" or not info.kv_transfer_address:
            return "the worker does not receive KV blocks (--kv-role both)"
        if sched.kv.tiers is None or not sched.kv.enable_prefix_caching:
            return "no host KV tier (--kv-offloading-size) or prefix caching off"
        return ""

    def start(self, request: Request, hint: KvPullHint) -> bool:
        """Asks the hint's source for the blocks this replica lacks; False: the request runs as usual (nothing to
        pull, or this replica cannot receive; the latter counted as a failure)."""
        if (request.pooling is not None or request.sampling.prompt_logprobs >= 0 or request.output_token_ids
                or request.mm_features):
            return False                 # no prefix hits for these here either, or images keyed with their hashes
        why = self.usable()
        if why:
            log.info("request %s: no KV pull from %s (%s); recomputed", request.request_id, hint.source, why)
            self.stats.failures += 1
            return False
        kv = self.engine.scheduler.kv
        n = min(hint.num_blocks, (request.num_prompt_tokens - 1) // kv.block_size)
        keys = ensure_block_hashes(request, n, kv.block_size, kv.hasher)[:n]
        first = 0
        while first < n and (kv.pool.get_cached_block(keys[first]) is not None or keys[first] in kv.tiers.host.entries):
            first += 1                   # held here already: asked for from the first block missing
        if first == n:
            return False
        job = _Pull(request, hint, keys[first:])
        self.jobs[request.request_id] = job
        self.stats.pulls += 1
        job.task = asyncio.create_task(self._ask(job), name=f"kv-pull-{request.request_id}")
        return True

    async def _ask(self, job: _Pull) -> None:
        start = time.monotonic()
        lease = self.engine.server_config.kv_transfer_lease
        call = engine_pb2.KvExportRequest(transfer_id=job.transfer_id, block_hashes=job.keys,
                                          destination=self.engine.worker_info.kv_transfer_address)
        rid = job.request.request_id
        span = request_tracing.kv_pull_start(getattr(self.engine.observer, "live", {}).get(rid), rid,
                                             job.hint.source, len(job.keys)) if tracing.ENABLED else None
        try:
            reply = await self._stub(job.hint.source).ExportKvBlocks(call, timeout=lease,
                                                                     metadata=tracing.grpc_metadata(span))
            job.answer = KvExport.from_pb(reply)
        except grpc.aio.AioRpcError as err:
            job.answer = KvExport(0, reason=f"{err.code().name}: {err.details()}")
        except asyncio.CancelledError:
            if span is not None:
                request_tracing.kv_pull_end(span, 0, 0, "aborted")
            raise
        self.stats.seconds += time.monotonic() - start
        if span is not None:
            request_tracing.kv_pull_end(span, job.answer.num_blocks, job.answer.bytes, job.answer.reason)
        if self.jobs.pop(job.request.request_id, None) is None:
            return                        # aborted meanwhile
        if not job.answer.num_blocks:
            log.info("request %s: KV pull from %s got nothing (%s); recomputed", job.request.request_id,
                     job.hint.source, job.answer.reason)
        self.ready.append(job)
        self.engine.wake()

    def _stub(self, address: str) -> engine_pb2_grpc.EngineStub:
        channel = self._channels.get(address)
        if channel is None:
            config = self.engine.server_config
            options = list(grpc_options.CLIENT)
            if config.tls.enabled and config.kv_pull_tls_server_name:
                options.append(("grpc.ssl_target_name_override", config.kv_pull_tls_server_name))
            channel = self._channels[address] = tls.open_channel(address, config.tls, options)
        return engine_pb2_grpc.EngineStub(channel)

    def abort(self, request_id: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is not None:
            job.task.cancel()             # A's handler is cancelled; its pin ends with its plan's answer
            self.discards.append(job.transfer_id)
            return
        for job in [j for j in self.ready if j.request.request_id == request_id]:
            self.ready.remove(job)
            if job.answer.num_blocks:
                self.discards.append(job.transfer_id)

    def num_held(self) -> int:
        return len(self.jobs) + len(self.ready)

    def has_ready(self) -> bool:
        return bool(self.ready or self.discards)

    # ---- B's plans (EngineLoop, around schedule and _apply)
    def admit_ready(self) -> None:
        """Answered pulls join the queue, with host slots reserved for the blocks that came (received in the
        same plan)."""
        self._moves, self._received = PdMoves(discards=self.discards), []
        self.discards = []
        tiers = self.engine.scheduler.kv.tiers if self.engine.scheduler is not None else None
        while self.ready:
            job = self.ready.popleft()
            got, rid = job.answer.num_blocks, job.request.request_id
            if got and tiers is not None:
                indexes, slots = tiers.reserve_receive(rid, job.keys[:got])
                self._moves.receives.append(PdReceive(job.transfer_id, indexes, slots))
                self._received += [(rid, job.keys[i], s) for i, s in zip(indexes, slots)]
                self.stats.pulled += 1
                self.stats.blocks += len(slots)
                self.stats.bytes += job.answer.bytes
            else:
                self.stats.failures += 1
                if got:
                    self._moves.discards.append(job.transfer_id)
            self.engine.admit_held(job.request)

    def fill_plan(self, plan: StepPlan) -> None:
        moves, self._moves = self._moves, None
        if not moves:
            return
        if plan.pd_moves is None:
            plan.pd_moves = moves
        else:
            plan.pd_moves.receives += moves.receives
            plan.pd_moves.discards += moves.discards
        if self._received:
            self.receiving[plan.step_id] = self._received
        self._received = []

    def on_result(self, plan: StepPlan, result: StepResult) -> None:
        received = self.receiving.pop(plan.step_id, None)
        sched = self.engine.scheduler
        if not received or sched is None or sched.kv.tiers is None:
            return
        report = result.pd_report
        failed_slots = set(report.failed_recv_slots) if report is not None else set()
        if result.error and report is None:
            failed_slots = {slot for _, _, slot in received}
        if sched.kv.tiers.on_receive([(key, slot) for _, key, slot in received], failed_slots):
            failed = {rid for rid, _, slot in received if slot in failed_slots}
            self.stats.failures += len(failed)
            self.stats.pulled -= len(failed)
            log.warning("pulled KV blocks of %s failed their checksum on the worker: recomputed", sorted(failed))

    def on_worker_lost(self) -> None:
        """The worker's staged transfers and host slots went with it."""
        self.receiving.clear()
        self.discards = []

    def report(self, exports: int, export_blocks: int) -> KvPullStats:
        self.stats.exports, self.stats.export_blocks = exports, export_blocks
        return self.stats

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
