"""Prefill/decode disaggregation under one scheduler: a prefill worker group beside the decode group.

The EngineLoop's own group is the decode group (workers started with --kv-role decode, or plain ones). Workers
started with --kv-role prefill attach here, to the prefill group, which has its own KV pool accounting and its own
Scheduler and step loop (`run`). For a request that goes disaggregated (`choose`):

  0. pd_choice.py decides, per request: disaggregated or local (forced, a group down, or by the step-cost models);
  1. its prompt runs on the prefill group as a one-token greedy request; the plan whose chunk completes the prompt
     also tells the prefill worker to send the prompt's full blocks to the decode worker's receiver after the
     forward (common/pd_transfer.py). The prefill pool holds the blocks until that step ends: the receiver verified
     every block's checksum and answered, or the send failed or timed out (the prefill side's lease);
  2. the scheduler reserves host-tier slots on the decode group for the blocks (kv_tiers.reserve_receive) and the
     next decode plan copies them in (checksums checked again); the decode request is admitted in that plan and
     restores them as a host-tier prefix once the result says they arrived (kv_tiers.restore_for waits for it);
  3. decoding continues on the decode group; the prefill request (one sampled token, discarded) has finished.

Anything that goes wrong is a local recompute on the decode group, counted in `fallbacks`, never a wrong token: a
send that fails, times out or is refused (a checksum mismatch), a receive that cannot fill its slots, the prefill
group lost (its requests fall back at once), a job past --kv-transfer-lease. An abort frees both sides: the prefill
request is aborted (its blocks freed), a transfer already staged on the decode worker is discarded by the next plan.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from steploop.common import tracing
from steploop.common.block_hashing import get_block_hasher
from steploop.common.pd_transfer import PdMoves, PdReceive, PdSend
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler import tracing as request_tracing
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.lora_steps import LoraSteps
from steploop.scheduler.pd_choice import Choice, PdChooser
from steploop.scheduler.prefix_cache import ensure_block_hashes
from steploop.scheduler.request import Request, RequestRejectedError
from steploop.scheduler.worker_group import GroupAssembler, WorkerGroup
from steploop.scheduler.worker_link import WorkerLink, WorkerLost

if TYPE_CHECKING:
    from steploop.scheduler.engine_loop import EngineLoop

log = logging.getLogger(__name__)

MODES = ("", "disaggregated", "local")


@dataclass
class PdStats:
    """Counters since start (the steploop:pd_* metrics)."""

    disaggregated: int = 0         # requests whose prompt went to the prefill group
    transfers: int = 0             # transfers the decode worker confirmed (every checksum verified)
    transfer_failures: int = 0     # sends that failed, timed out or were refused, and receives that failed
    fallbacks: int = 0             # disaggregated requests recomputed on the decode group instead
    local: int = 0                 # requests run on the decode group alone while a prefill group was attached
    bytes: int = 0                 # bytes of confirmed transfers
    transfer_seconds: float = 0.0  # prefill-worker time spent sending
    prefill_free_blocks: int = 0   # the prefill pool now (gauges)
    prefill_total_blocks: int = 0
    prefill_up: bool = False
    prefill_requests: int = 0      # requests whose prompt is on the prefill group now
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)   # (choice, reason) -> requests (pd_choice)


@dataclass
class PdJob:
    request: Request               # the decode side's request, admitted to the decode scheduler at hand-off
    prefill: Request               # its prompt as a one-token request on the prefill group
    started: float = field(default_factory=time.monotonic)
    sent: bool = False             # the transfer is in a prefill plan
    target_lost: bool = False      # the decode worker it would go to is gone: recomputed on the next one


class PdDisagg:
    def __init__(self, engine: EngineLoop):
        self.engine = engine
        cfg = engine.server_config
        self.lease = cfg.kv_transfer_lease
        self.chooser = PdChooser(self, cfg.disagg_policy, cfg.disagg_min_prompt_tokens)
        self.timeout = cfg.tp_collective_timeout
        self.assembler = GroupAssembler(1, self.timeout)
        self.group: WorkerGroup | None = None
        self.scheduler = None
        self.jobs: dict[str, PdJob] = {}             # on the prefill group
        self.ready: deque[tuple[PdJob, bool]] = deque()   # hand-offs for the next decode plan (ok: transfer staged)
        self.discards: list[str] = []                # staged transfers no request will use
        self.receiving: dict[int, list[tuple[str, bytes, int]]] = {}   # decode step id -> (request id, hash, slot)
        self.stats = PdStats()
        self._wakeup = asyncio.Event()
        self.with_lora = False                                  # the prefill group loads adapters (--enable-lora)
        self._lora_unloaded: set[str] | None = None             # adapters unloaded, as the prefill group's steps see it
        self._moves: PdMoves | None = None                      # for the decode plan being built
        self._received: list[tuple[str, bytes, int]] = []       # its receives: (request id, hash, host slot)

    # ---- the prefill group
    def attach(self, link: WorkerLink) -> None:
        info = link.info
        decode = self.engine.worker_info
        if decode is not None and (info.model_name, info.block_size, info.dtype, info.cache_dtype) != (
                decode.model_name, decode.block_size, decode.dtype, decode.cache_dtype):
            from steploop.common.errors import InvalidRequestError
            raise InvalidRequestError(f"prefill worker {info.worker_id} serves {info.model_name!r} (block size "
                                      f"{info.block_size}, {info.dtype}, KV cache {info.cache_dtype}); the decode "
                                      f"group {decode.model_name!r} (block size {decode.block_size}, {decode.dtype}, "
                                      f"KV cache {decode.cache_dtype}): they must match",
                                      param="model")
        if not self.assembler.pending and info.world_size != self.assembler.world_size:
            # the prefill group is as large as its workers say (-tp N on each); its own size, not the decode group's
            generation, self.assembler = self.assembler.generation, GroupAssembler(info.world_size, self.timeout)
            self.assembler.generation = generation
        group = self.assembler.add(link)     # refuses a rank that cannot join this group, naming why
        if self.group is not None:
            self.lose(f"replaced by worker {info.worker_id}")
        if group is None:
            return
        config = dataclasses.replace(self.engine.sched_config, async_scheduling=False)
        kv = KVCacheManager(group.info.num_kv_blocks, group.info.block_size, config.enable_prefix_caching,
                            get_block_hasher(config.prefix_caching_hash_algo))
        lora = None
        if group.info.lora_shapes is not None and self.engine.server_config.lora.enable_lora:
            # its workers run --enable-lora: LoRA prompts may run there, the adapters loaded as on the decode group
            if self._lora_unloaded is None:
                self._lora_unloaded = self.engine.lora.track_unloads()
            lora = LoraSteps(self.engine.server_config.lora.max_loras, self._lora_unloaded)
        self.scheduler = make_scheduler(config, kv, group.info.max_model_len, list(group.info.eos_token_ids),
                                        lora=lora)
        self.with_lora = lora is not None
        self.scheduler.encoder.whole_images = group.info.images_whole     # Gemma 3: prompt chunks keep images whole
        self.scheduler.encoder.depth = group.info.encoder_layers          # encoder slices (0: whole images)
        self.group = group
        log.info("prefill group %s attached (-tp %d): %d KV blocks", group.info.worker_id, group.world_size,
                 group.info.num_kv_blocks)
        self._wakeup.set()

    def detach(self, link: WorkerLink, reason: str) -> None:
        link.close(reason)
        self.assembler.discard(link)
        if self.group is not None and link in self.group.links:
            self.lose(reason)

    def lose(self, reason: str) -> None:
        """The prefill group is gone: every request it held is recomputed on the decode group."""
        group, self.group, self.scheduler = self.group, None, None
        if group is not None:
            group.close(reason)
        log.warning("prefill group lost (%s); %d requests fall back to local prefill", reason, len(self.jobs))
        for job in list(self.jobs.values()):
            self._hand_off(job, ok=False)

    @property
    def up(self) -> bool:
        return self.group is not None and not self.group.is_closed

    @property
    def serves_lora(self) -> bool:
        """The prefill group's workers run --enable-lora (and so does this scheduler): LoRA prompts may go there."""
        return self.scheduler is not None and self.with_lora

    # ---- per request
    def choose(self, request: Request, mode: str) -> Choice:
        """Disaggregated or local (pd_choice.py), counted per choice and reason once a prefill group has attached.
        With a prefill group up, a local choice is also counted in `local`: a LoRA request says so instead of
        vanishing."""
        choice = self.chooser.choose(request, mode)
        if self.up or self.stats.decisions:
            key = (choice.label, choice.reason)
            self.stats.decisions[key] = self.stats.decisions.get(key, 0) + 1
        if not choice.disaggregate and self.up:
            self.stats.local += 1
        return choice

    def trace_choice(self, request_id: str, choice: Choice) -> None:
        """The choice and its estimates on the request's span (called once the span exists)."""
        if tracing.ENABLED:
            request_tracing.pd_choice(getattr(self.engine.observer, "live", {}).get(request_id), choice)

    def start(self, request: Request) -> bool:
        """Queues the prompt on the prefill group; False: that group cannot hold it (it runs locally)."""
        prefill = Request(request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                          sampling=SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=request.cache_salt,
                          lora_name=request.lora_name, lora_path=request.lora_path)   # the same blocks' keys
        try:
            self.scheduler.add_request(prefill)
        except RequestRejectedError as exc:
            log.info("request %s runs locally: the prefill group cannot take it (%s)", request.request_id, exc)
            self.stats.local += 1
            return False
        self.jobs[request.request_id] = PdJob(request, prefill)
        self.stats.disaggregated += 1
        self._wakeup.set()
        return True

    def abort(self, request_id: str) -> bool:
        """Drops a request still on the prefill side (its blocks freed there); True when it was there."""
        job = self.jobs.pop(request_id, None)
        if job is None:
            kept = [(j, ok) for j, ok in self.ready if j.request.request_id != request_id]
            for j, ok in self.ready:
                if j.request.request_id == request_id and ok:
                    self.discards.append(request_id)
            found = len(kept) != len(self.ready)
            self.ready = deque(kept)
            return found
        if self.scheduler is not None:  # a send in flight still answers: a landed one is discarded then
            self.scheduler.abort_requests([request_id])
        self._wakeup.set()
        return True

    def num_held(self) -> int:
        return len(self.jobs) + len(self.ready)

    def _hand_off(self, job: PdJob, ok: bool) -> None:
        self.jobs.pop(job.request.request_id, None)
        if not ok:
            self.stats.fallbacks += 1
        self.ready.append((job, ok))
        self.engine.wake()

    # ---- the decode side's plans (called by EngineLoop around schedule and _apply)
    def has_ready(self) -> bool:
        return bool(self.ready or self.discards)

    def admit_ready(self) -> None:
        """Before the decode scheduler plans: requests whose prompt finished join its queue, with host slots
        reserved for their staged blocks (the receive goes in the same plan)."""
        sched = self.engine.scheduler
        self._moves, self._received = PdMoves(discards=self.discards), []
        self.discards = []
        while self.ready:
            job, ok = self.ready.popleft()
            request = job.request
            if ok and sched is not None and sched.kv.tiers is not None:
                kv = sched.kv
                n = (request.num_prompt_tokens - 1) // kv.block_size
                hashes = ensure_block_hashes(request, n, kv.block_size, kv.hasher)[:n]
                indexes, slots = kv.tiers.reserve_receive(request.request_id, hashes)
                self._moves.receives.append(PdReceive(request.request_id, indexes, slots))
                self._received += [(request.request_id, hashes[i], s) for i, s in zip(indexes, slots)]
            elif ok:
                self._moves.discards.append(request.request_id)
                self.stats.fallbacks += 1
            self.engine.admit_handed_off(request)

    def fill_plan(self, plan: StepPlan) -> None:
        moves, self._moves = self._moves, None
        if moves:
            plan.pd_moves = moves
            self.receiving[plan.step_id] = self._received
        self._received = []

    def on_decode_result(self, plan: StepPlan, result: StepResult) -> None:
        received = self.receiving.pop(plan.step_id, None)
        if not received:
            return
        tiers = self.engine.scheduler.kv.tiers if self.engine.scheduler is not None else None
        if tiers is None:
            return
        report = result.pd_report
        failed_slots = set(report.failed_recv_slots) if report is not None else set()
        if result.error and report is None:
            failed_slots = {slot for _, _, slot in received}
        failed = tiers.on_receive([(key, slot) for _, key, slot in received], failed_slots)
        if failed:
            self.stats.transfer_failures += 1
            self.stats.fallbacks += len({rid for rid, _, slot in received if slot in failed_slots})
            log.warning("%d received KV blocks failed their checksum on the decode worker: recomputed", failed)

    def on_decode_lost(self) -> None:
        """The decode group is gone (its host slots and staged transfers with it): pending receives resolve as
        nothing; requests still on the prefill side will fall back (their target receiver is gone)."""
        self.receiving.clear()
        self.discards = []
        for job in self.jobs.values():
            job.target_lost = True

    # ---- the prefill group's loop
    async def run(self) -> None:
        while True:
            if not self.up or self.scheduler is None or not self.scheduler.has_unfinished_requests():
                self._expire()
                self._check_idle()
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            group, sched = self.group, self.scheduler
            plan = sched.schedule()
            self._add_sends(plan)
            if not (plan.scheduled_handles or plan.finished_handles or plan.preempted_handles or plan.pd_moves):
                await asyncio.sleep(0.01)     # nothing fits right now (a poll interval while blocks free up)
                continue
            try:
                await group.send(plan)
                result = await asyncio.wait_for(group.recv(plan), self.lease)
            except (WorkerLost, asyncio.TimeoutError) as exc:
                if self.group is group:
                    self.lose(str(exc) or "a prefill step outlived --kv-transfer-lease")
                continue
            if self.scheduler is not sched:      # lost and maybe replaced while this step ran
                continue
            sched.update_from_output(plan, result)
            self._on_prefill_result(plan, result)
            self._expire()

    def _add_sends(self, plan: StepPlan) -> None:
        """The plan whose chunk completes a prompt sends its full blocks after the forward. schedule() has
        advanced num_computed_tokens past this plan's tokens already (Scheduler._advance)."""
        decode = self.engine.worker_info
        by_handle = {job.prefill.handle: job for job in self.jobs.values()}
        sends = []
        for handle in plan.scheduled_handles:
            job = by_handle.get(handle)
            if job is None or job.sent or job.prefill.num_computed_tokens < job.prefill.num_prompt_tokens:
                continue
            if job.target_lost or decode is None:
                continue
            num_full = (job.prefill.num_prompt_tokens - 1) // decode.block_size
            sends.append(PdSend(job.request.request_id, self.scheduler.kv.get_block_ids(job.prefill)[:num_full]))
            job.sent = True
        if sends:
            plan.pd_moves = PdMoves(address=decode.kv_transfer_address, sends=sends)

    def _on_prefill_result(self, plan: StepPlan, result: StepResult) -> None:
        report = result.pd_report
        sent = set(report.sent) if report is not None else set()
        if report is not None:
            self.stats.transfer_seconds += report.seconds
            self.stats.bytes += report.bytes_sent
            self.chooser.link.observe(report.bytes_sent, report.seconds)   # the bandwidth the choice prices
        for send in plan.pd_moves.sends if plan.pd_moves else ():
            ok = send.transfer_id in sent
            if tracing.ENABLED:          # one span per transfer; the send's time is the step's (several share it)
                rec = getattr(self.engine.observer, "live", {}).get(send.transfer_id)
                decode = self.engine.worker_info
                request_tracing.kv_transfer(rec, send.transfer_id, len(send.block_ids),
                                            len(send.block_ids) * (decode.transfer_block_bytes if decode else 0),
                                            report.seconds if report is not None else 0.0, ok)
            self.stats.transfers += ok
            if not ok:
                self.stats.transfer_failures += 1
            job = self.jobs.get(send.transfer_id)
            if job is None:                      # aborted meanwhile
                if ok:
                    self.discards.append(send.transfer_id)
                    self.engine.wake()
                continue
            self._hand_off(job, ok and not job.target_lost)
        # A job whose request finished on the prefill side without a send (its step failed): recomputed.
        for job in list(self.jobs.values()):
            if job.prefill.is_finished or (job.target_lost and not job.sent):
                if self.scheduler is not None and not job.prefill.is_finished:
                    self.scheduler.abort_requests([job.request.request_id])
                self._hand_off(job, ok=False)

    def _expire(self) -> None:
        """Jobs past the lease go local (between prefill plans: none of their blocks is being read)."""
        now = time.monotonic()
        for job in [j for j in self.jobs.values() if now - j.started > self.lease]:
            log.warning("request %s: its prefill outlived --kv-transfer-lease %g s; recomputed locally",
                        job.request.request_id, self.lease)
            if self.scheduler is not None:
                self.scheduler.abort_requests([job.request.request_id])
            self._hand_off(job, ok=False)

    def _check_idle(self) -> None:
        """With no prefill work every prefill block is free again (cached-but-free counts as free)."""
        sched = self.scheduler
        if sched is None or sched.has_unfinished_requests() or self.jobs:
            return
        kv = sched.kv
        if kv.num_free_blocks != kv.num_usable_blocks:
            raise AssertionError(f"prefill KV block leak at idle: {kv.num_free_blocks} of {kv.num_usable_blocks} "
                                 f"blocks free with no live request")

    def report(self) -> PdStats:
        sched = self.scheduler
        return dataclasses.replace(self.stats, decisions=dict(self.stats.decisions), prefill_up=self.up,
                                   prefill_requests=len(self.jobs),
                                   prefill_free_blocks=sched.kv.num_free_blocks if sched is not None else 0,
                                   prefill_total_blocks=sched.kv.num_usable_blocks if sched is not None else 0)
