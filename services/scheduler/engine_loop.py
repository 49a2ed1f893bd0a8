"""EngineLoop: the scheduler service's step loop and everything live around it.

    schedule() -> StepPlan ──▶ worker (plan stream) ──▶ StepResult ──▶ update_from_output() ──▶ caller streams

It owns the transport-free Scheduler, the attached WorkerGroup (a single worker is a group of one rank) and one
output sink per live request (a RequestStream for a Generate call, a SessionSink for a request on a Session
stream). The KV pool is sized by the first group that attaches; requests that arrive before that wait (up to
--worker-timeout). A group that is lost (any of its ranks) is preemption of everything it held: the requests
stay, are recomputed when a group is back, and their callers' streams stay open.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

from steploop.common.block_hashing import get_block_hasher, hasher_root
from steploop.common.engine_contract import EngineRequest
from steploop.common.errors import EngineError, InvalidRequestError, OverloadedError, UnavailableError
from steploop.common.step_contract import StepPlan, StepResult, WorkerInfo
from steploop.scheduler import kv_tiers
from steploop.scheduler.async_scheduler import make_scheduler, plans_in_flight
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.engine_control import EngineControl
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.kv_events.hub import KvEventHub
from steploop.scheduler.kv_pull_export import KvPullExport
from steploop.scheduler.kv_pull_import import KvPullImport
from steploop.scheduler.kv_tiers import KvTiers, TierStats
from steploop.scheduler.lora_registry import LoraRegistry
from steploop.scheduler.lora_steps import LoraSteps
from steploop.scheduler.metrics import make_observer
from steploop.scheduler.pd_disagg import MODES as PD_MODES, PdDisagg
from steploop.scheduler.request import Request, RequestOutput, RequestRejectedError, RequestStatus
from steploop.scheduler.request_outputs import validate_request
from steploop.scheduler.request_stream import FailedOutput, OutputSink, RequestStream
from steploop.scheduler.scheduler import Scheduler
from steploop.scheduler.server_config import ServerConfig
from steploop.scheduler.stats import EngineLoad, SchedulerCounters, StepStats
from steploop.scheduler.worker_group import GroupAssembler, WorkerGroup
from steploop.scheduler.worker_link import WorkerLink, WorkerLost

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, sched_config: SchedulerConfig, server_config: ServerConfig):
        self.sched_config = sched_config
        self.server_config = server_config
        self.scheduler: Scheduler | None = None     # built when the first worker says how many blocks it has
        self.worker_info: WorkerInfo | None = None  # of the first worker; later ones must match its model
        self.group: WorkerGroup | None = None       # --tensor-parallel-size ranks (one by default)
        if server_config.pipeline_parallel_size > 1 and sched_config.num_speculative_tokens:
            raise ValueError(f"--speculative-ngram with -pp {server_config.pipeline_parallel_size}: drafts are "
                             "verified only without pipeline stages")
        self.assembler = GroupAssembler(server_config.tensor_parallel_size, server_config.tp_collective_timeout,
                                        server_config.pipeline_parallel_size)
        self.streams: dict[str, OutputSink] = {}
        self.accepting = True                       # False once shutdown began: new requests get UNAVAILABLE
        self._pending: list[Request] = []           # arrived before any worker attached
        self._wakeup = asyncio.Event()
        self.num_steps = 0
        self.last_progress = time.monotonic()       # last finished step, or when work arrived while idle
        self.lost_since: float | None = time.monotonic()
        self._retired_counters = SchedulerCounters()    # of schedulers replaced since start
        self._retired_tier_stats: dict[str, TierStats] = {}   # of KV tiers replaced since start (kv_tiers.py)
        self.lora = LoraRegistry(server_config.lora)    # the LoRA adapters served (lora_registry.py)
        # Metrics, request logs and spans (metrics.py): fed by data pushed from here, and load_report.
        self.observer = make_observer(self.load_report, sched_config.enable_prefix_caching)
        algo = sched_config.prefix_caching_hash_algo
        self.kv_events = (KvEventHub(sched_config.kv_events, algo, hasher_root(algo))
                          if sched_config.kv_events.enable_kv_cache_events else None)
        self.control = EngineControl(self)          # pause / resume / weight updates (engine_control.py)
        self.pd = PdDisagg(self)                    # the prefill group, when --kv-role prefill workers attach
        self.kv_pull = KvPullImport(self)           # prompts whose prefix another replica caches (kv_pull_import.py)
        self.kv_export = KvPullExport(self)         # this replica's blocks other replicas pull (kv_pull_export.py)

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, req: EngineRequest,
                    make_sink: Callable[[str], OutputSink] = RequestStream) -> OutputSink:
        """Validates and queues one request; raises InvalidRequestError / OverloadedError. Its outputs go to
        make_sink(request_id), made only once the request is accepted."""
        if not self.accepting:
            raise UnavailableError("the scheduler is shutting down")
        num_waiting = self._num_waiting()
        if num_waiting >= self.server_config.max_waiting:
            raise OverloadedError(f"{num_waiting} requests are waiting (--max-waiting "
                                  f"{self.server_config.max_waiting}); retry shortly")
        request_id = req.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already live", param="request_id",
                                      code="duplicate_request_id")
        prompt = list(req.prompt_token_ids)
        if not prompt:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
        if not self.has_work() and self.group is not None:
            self.last_progress = time.monotonic()
        if "\x00" in req.cache_salt:        # NUL separates salt and adapter in block 0's key (block_hashing.py)
            raise InvalidRequestError("cache_salt may not contain a NUL character", param="cache_salt")
        lora_path = self.lora.resolve(req.lora_name) if req.lora_name else ""
        if req.disaggregation not in PD_MODES:
            raise InvalidRequestError(f"disaggregation {req.disaggregation!r} must be 'disaggregated' or 'local'",
                                      param="disaggregation")
        request = Request(request_id=request_id, prompt_token_ids=prompt, sampling=req.sampling,
                          priority=req.priority, background=req.background, cache_salt=req.cache_salt or None,
                          pooling=req.pooling,
                          output_token_ids=list(req.resume_output_token_ids),   # migrated: outputs, not prompt
                          lora_name=req.lora_name or None, lora_path=lora_path, mm_features=list(req.mm_features),
                          beam=req.beam)
        choice = None
        if self.control.hold(request):      # paused: validated and queued on resume (admit_held)
            pass
        elif self.scheduler is None:
            self._pending.append(request)
        elif req.beam is None and (choice := self.pd.choose(request, req.disaggregation)).disaggregate:
            self._check(request)            # (beams run on the decode group)
            if not self.pd.start(request):  # its prompt runs on the prefill group first (pd_disagg.py)
                self._admit(request)
        elif req.kv_pull is not None and req.beam is None:
            self._check(request)
            if not self.kv_pull.start(request, req.kv_pull):   # held while its prefix is pulled from another replica
                self._admit(request)
        else:
            self._admit(request)
        self.observer.on_arrival(request)
        if choice is not None:
            self.pd.trace_choice(request_id, choice)
        sink = self.streams[request_id] = make_sink(request_id)
        self._wakeup.set()
        return sink

    def _admit(self, request: Request) -> None:
        """Checks the prompt against the model; the scheduler resolves max_tokens and checks the context."""
        self._check(request)
        try:
            self.scheduler.add_request(request)
        except RequestRejectedError as exc:
            raise InvalidRequestError(str(exc), param=exc.param, code=exc.code) from exc

    def _check(self, request: Request) -> None:
        """What _admit refuses, without queueing (a disaggregated request is queued here after its prefill)."""
        info = self.worker_info
        sampling = request.sampling
        if len(sampling.constraint_fields) > 1:
            names = sampling.constraint_fields
            raise InvalidRequestError(f"{' and '.join(names)} are set: give one structured-output constraint",
                                      param=names[1])
        if any(not word for word in sampling.bad_words):
            raise InvalidRequestError("each bad word must have at least one token", param="bad_words")
        for param, ids in (("prompt", request.prompt_token_ids), ("resume_output_token_ids", request.output_token_ids),
                           ("allowed_token_ids", sampling.allowed_token_ids),
                           ("bad_words", [t for word in sampling.bad_words for t in word])):
            bad = [t for t in ids if t >= info.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is out of range for vocab size {info.vocab_size}",
                                          param=param)
        if request.mm_features and not info.accepts_images:
            raise InvalidRequestError(f"model {info.model_name!r} is a text-only model: it does not take images",
                                      param="messages", code="invalid_value")
        try:
            validate_request(request, self.scheduler.kv, self.scheduler.max_model_len)
        except RequestRejectedError as exc:
            raise InvalidRequestError(str(exc), param=exc.param, code=exc.code) from exc

    def admit_handed_off(self, request: Request) -> None:
        """A disaggregated request's prompt is done on the prefill group (or fell back): it joins the queue."""
        self.admit_held(request)

    def admit_held(self, request: Request) -> None:
        """A request held (while paused, or on the prefill group) joins the queue; one that cannot run ends with
        its error."""
        if self.scheduler is None:
            self._pending.append(request)
            return
        try:
            self._admit(request)
        except InvalidRequestError as exc:
            self.observer.on_abort(request.request_id, "rejected", "error")
            self._fail(request.request_id, exc)

    def _num_waiting(self) -> int:
        queued = self.scheduler.num_waiting if self.scheduler is not None else 0
        held = self.pd.num_held() + self.kv_pull.num_held()     # on the prefill group, or being pulled
        return len(self._pending) + len(self.control.held) + queued + held

    def wake(self) -> None:
        self._wakeup.set()

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Drop the request at once (its blocks come back before the next step). A caller still listening (an
        Abort RPC from elsewhere) gets a last chunk with FINISH_REASON_ABORT."""
        self.observer.on_abort(request_id, reason)
        stream = self.streams.pop(request_id, None)
        self._pending = [r for r in self._pending if r.request_id != request_id]
        self.control.drop(request_id)
        self.control.request_ended()
        self.pd.abort(request_id)           # still on the prefill side: its blocks there are freed
        self.kv_pull.abort(request_id)      # still being pulled: the call to the source is cancelled
        outputs = self.scheduler.abort_requests([request_id]) if self.scheduler is not None else []
        if stream is not None:
            stream.put(outputs[0] if outputs else RequestOutput(request_id, [], None, RequestStatus.FINISHED_ABORTED,
                                                                None, 0, 0, 0))
        self._wakeup.set()

    def _dispatch(self, outputs) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finish_reason is not None:
                del self.streams[out.request_id]
                self.control.request_ended()

    # ---- workers --------------------------------------------------------------------------------------------
    def attach(self, link: WorkerLink) -> None:
        """A worker (one rank) says hello and joins the group being assembled; the group attaches once all its
        ranks are in (a single worker at once). A rank that arrives while a group serves breaks that group (a
        restarted worker reconnects before its old stream's end is noticed), whose requests are then recomputed."""
        if link.info.kv_role == "prefill":
            self.pd.attach(link)
            return
        if self.worker_info is not None and link.info.model_name != self.worker_info.model_name:
            raise InvalidRequestError(f"worker serves {link.info.model_name!r}, this scheduler serves "
                                      f"{self.worker_info.model_name!r}", param="model")
        group = self.assembler.add(link)     # refuses a rank that cannot join, naming why
        if self.group is not None:
            log.warning("worker %s (rank %d) replaces attached worker %s", link.info.worker_id, link.info.rank,
                        self.group.info.worker_id)
            self._lose(f"replaced by worker {link.info.worker_id} (rank {link.info.rank})")
        if group is None:
            return
        info = group.info
        self.lora.attach(info.lora_shapes)
        if (self.scheduler is None or info.num_kv_blocks != self.worker_info.num_kv_blocks
                or info.pooling != self.worker_info.pooling):     # a pooling worker serves other requests
            self._build_scheduler(info)
        kv_tiers.retire(self._retired_tier_stats, self.scheduler.kv.tiers)
        self.scheduler.kv.attach_tiers(self._tiers_for(info))
        self.worker_info, self.group, self.lost_since = info, group, None
        self.control.restore_on_attach()     # after weight updates: the served weights before its first step
        self.observer.on_attach(info)
        self.last_progress = time.monotonic()
        log.info("worker %s attached: %d KV blocks of %d tokens, max_model_len %d", info.worker_id,
                 info.num_kv_blocks, info.block_size, info.max_model_len)
        self._wakeup.set()

    def _build_scheduler(self, info: WorkerInfo) -> None:
        old = self.scheduler
        kv = KVCacheManager(info.num_kv_blocks, info.block_size, self.sched_config.enable_prefix_caching,
                            get_block_hasher(self.sched_config.prefix_caching_hash_algo),
                            None if self.kv_events is None else self.kv_events.recorder)
        if self.kv_events is not None:
            if old is not None:
                self.kv_events.recorder.cleared()     # a new pool: the old one's keys are gone
            self.kv_events.watch_cache(lambda: (list(kv.pool.block_hash.values()), kv.block_size))
        if old is not None:
            self._retired_counters += old.counters()
        lora = LoraSteps(self.server_config.lora.max_loras, self.lora.unloaded)
        self.scheduler = make_scheduler(self.sched_config, kv, info.max_model_len, list(info.eos_token_ids),
                                        info.pooling, lora, self.server_config.pipeline_parallel_size)
        self.scheduler.encoder.whole_images = info.images_whole
        self.scheduler.encoder.depth = info.encoder_layers          # 0: images encode whole
        self.worker_info = info
        carried = self._pending + ([] if old is None else old.drain_requests())
        self._pending = []
        for request in carried:
            try:
                self._admit(request)
            except InvalidRequestError as exc:
                self.observer.on_abort(request.request_id, "rejected", "error")
                self._fail(request.request_id, exc)

    def _tiers_for(self, info: WorkerInfo) -> KvTiers | None:
        """The KV tiers below the pool the worker says it has (a restarted one's disk files indexed back)."""
        if not info.kv_host_blocks:
            return None
        tiers = KvTiers(info.kv_host_blocks, info.kv_disk_blocks, info.kv_block_bytes, info.kv_disk_hashes)
        if self.kv_events is not None:
            tiers.attach_events(self.kv_events.recorder, info.block_size)
        return tiers

    def detach(self, link: WorkerLink, reason: str) -> None:
        """A rank's stream ended (the Attach handler): it leaves the group being assembled, and one rank lost is
        the whole serving group lost."""
        if link.info.kv_role == "prefill":
            self.pd.detach(link, reason)
            return
        link.close(reason)
        self.assembler.discard(link)
        if self.group is not None and link in self.group.links:
            self._lose(reason, ordered=link.ended_by_stop)

    def _lose(self, reason: str, ordered: bool = False) -> None:
        """The serving group is gone: close every rank's link and preempt everything (recomputed when a group is
        back)."""
        group, self.group, self.lost_since = self.group, None, time.monotonic()
        group.close(reason)
        self.observer.on_detach()
        self.pd.on_decode_lost()
        self.kv_pull.on_worker_lost()
        self.kv_export.on_worker_lost()
        if self.scheduler is not None:
            self.scheduler.preempt_all()
        if self.kv_events is not None:
            self.kv_events.flush()                  # AllBlocksCleared now, not at the next step
        log.log(logging.INFO if ordered else logging.WARNING, "worker %s detached (%s)%s", group.info.worker_id,
                reason, "" if ordered else "; its requests will be recomputed when a worker is back")

    # ---- the loop -------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._pending) or self.pd.has_ready() or self.kv_pull.has_ready() or self.kv_export.has_work() \
            or (self.scheduler is not None and self.scheduler.has_unfinished_requests())

    def can_step(self) -> bool:
        """Work that may run now: not while paused (engine_control.py) or while a control operation waits for the
        step boundary."""
        return self.has_work() and not self.control.frozen and not self.control.has_pending

    async def run(self) -> None:
        """The decode (or only) group's loop, and the prefill group's beside it (pd_disagg.py)."""
        await asyncio.gather(self._run(), self.pd.run())

    async def _run(self) -> None:
        """schedule, send, await, update. With async scheduling plan N+1 is sent before result N is applied; with
        -pp N up to N plans are outstanding, one per stage (pipeline_scheduler.py), answered in order."""
        outstanding: deque[tuple[StepPlan, int]] = deque()   # plans sent, with their size in bytes
        window = plans_in_flight(self.sched_config, self.server_config.pipeline_parallel_size)
        group: WorkerGroup | None = None
        while True:
            if not outstanding:         # plans in flight are answered by the group they went to, or not at all
                group = await self._wait_for_work()
            sent = False
            try:
                if not outstanding and self.control.has_pending:   # a step boundary: pause / weight updates
                    await self.control.run_pending(group)
                    continue
                if len(outstanding) < window and self.can_step():
                    self.pd.admit_ready()
                    self.kv_pull.admit_ready()
                    plan = self.scheduler.schedule()
                    self.pd.fill_plan(plan)
                    self.kv_pull.fill_plan(plan)
                    self.kv_export.fill_plan(plan)
                    if (plan.scheduled_handles or plan.finished_handles or plan.preempted_handles
                            or plan.kv_moves is not None or plan.pd_moves is not None):
                        self.observer.on_plan(plan, self.scheduler.new_request_ids(plan))
                        bytes_before = group.bytes_sent
                        await group.send(plan)
                        outstanding.append((plan, group.bytes_sent - bytes_before))
                        sent = True
                if outstanding and (len(outstanding) == window or not sent):
                    plan, plan_bytes = outstanding.popleft()
                    self._apply(plan, await group.recv(plan), plan_bytes)
                elif not sent:
                    await self._wait(timeout=0.05)   # nothing fits right now: wait for an abort or a finish
            except WorkerLost as exc:
                outstanding.clear()
                if self.group is group:
                    self._lose(str(exc))
                elif self.scheduler is not None:
                    # The Attach handler detached this group first (and a new worker may be attached by now): the
                    # plans this loop scheduled on it since then died with it, so preempt those requests too.
                    self.scheduler.preempt_all()

    async def step_now(self, group: WorkerGroup, plan: StepPlan) -> None:
        """Sends one plan built outside schedule() (engine_control.py: a plan that only preempts) and applies its
        result; called with no plan outstanding."""
        self.observer.on_plan(plan, [])
        bytes_before = group.bytes_sent
        await group.send(plan)
        self._apply(plan, await group.recv(plan), group.bytes_sent - bytes_before)

    def _apply(self, plan: StepPlan, result: StepResult, plan_bytes: int) -> None:
        self.num_steps += 1
        self.last_progress = time.monotonic()
        if result.error:
            log.error("step %d failed on the worker: %s", plan.step_id, result.error)
        self.pd.on_decode_result(plan, result)
        self.kv_pull.on_result(plan, result)
        self.kv_export.on_result(plan, result)
        outputs = self.scheduler.update_from_output(plan, result)
        self.observer.on_step(StepStats(plan.step_id, plan.total_num_scheduled_tokens, result.forward_seconds,
                                        plan_bytes, outputs))
        self._dispatch(outputs)
        if self.kv_events is not None:
            self.kv_events.flush()

    def check_idle(self) -> None:
        """At idle every KV block must be free again (cached-but-free counts as free); anything else is a leak,
        and a leak left alone slowly starves the engine. Fail loudly: the step loop crashes and the service
        exits (a supervisor restarts it) rather than serve on with a shrinking pool."""
        if self.scheduler is None or self.has_work():
            return
        self.scheduler.check_integrity()
        kv = self.scheduler.kv
        if kv.num_free_blocks != kv.num_usable_blocks:
            raise AssertionError(f"KV block leak at idle: {kv.num_free_blocks} of {kv.num_usable_blocks} "
                                 f"blocks free with no live request")

    async def _wait_for_work(self) -> WorkerGroup:
        self.check_idle()
        while True:
            if self.control.has_pending:
                return self.group
            if self.group is not None and self.can_step():
                return self.group
            if self.group is None and self.has_work():
                self._fail_if_no_worker()
            await self._wait(timeout=0.5)

    async def _wait(self, timeout: float) -> None:
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _fail_if_no_worker(self) -> None:
        waited = time.monotonic() - (self.lost_since or time.monotonic())
        if waited < self.server_config.worker_timeout:
            return
        message = (f"no worker attached for {waited:.0f} s (--worker-timeout "
                   f"{self.server_config.worker_timeout:g}); start a worker pointed at this scheduler")
        ids = [r.request_id for r in self._pending] + list(self.streams)
        self._pending = []
        for request_id in dict.fromkeys(ids):
            if self.scheduler is not None:
                self.scheduler.abort_requests([request_id])
            self.observer.on_abort(request_id, "no_worker", "error")
            self._fail(request_id, UnavailableError(message))

    def _fail(self, request_id: str, error: EngineError) -> None:
        """Ends a caller's stream with a gRPC error (the request never ran, or lost its worker for good)."""
        stream = self.streams.pop(request_id, None)
        self.control.request_ended()
        if stream is not None:
            stream.put(FailedOutput(request_id, error))

    # ---- health and load ------------------------------------------------------------------------------------
    def is_serving(self) -> bool:
        """A worker is attached and, whenever work is pending, a step finished recently (busy ≠ hung)."""
        if self.group is None or self.group.is_closed:
            return False
        return not self.can_step() or time.monotonic() - self.last_progress < self.server_config.hang_timeout

    def load_report(self) -> EngineLoad:
        """What the engine holds now (Engine.GetLoadReport, the vllm:* gauges, the stats line)."""
        sched = self.scheduler
        attached = 0 if self.group is None else self.group.world_size
        if sched is None:
            return EngineLoad(num_waiting=self._num_waiting(), num_steps=self.num_steps,
                              counters=self._retired_counters, workers_attached=attached,
                              paused=self.control.paused, weight_updates=self.control.weight_updates,
                              weight_version=self.control.weight_version)
        kv = sched.kv
        return EngineLoad(
            num_running=sched.num_running, num_waiting=self._num_waiting(),
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks, kv_cache_usage=kv.usage,
            num_steps=self.num_steps, counters=self._retired_counters + sched.counters(),
            step_cost=sched.step_cost(), workers_attached=attached,
            running_lora_adapters=tuple(sched.lora.running), waiting_lora_adapters=tuple({r.lora_name: None for r in sched.waiting if r.lora_name}),
            max_loras=self.server_config.lora.max_loras if self.server_config.lora.enable_lora else 0,
            paused=self.control.paused, weight_updates=self.control.weight_updates,
            weight_version=self.control.weight_version,
            kv_tiers=kv.tiers.report_load(self._retired_tier_stats) if kv.tiers is not None else (),
            pd=self.pd.report(),
            kv_pull=self.kv_pull.report(self.kv_export.exports, self.kv_export.export_blocks),
            encoder_cache=(sched.encoder.num_entries, sched.encoder.used, sched.encoder.cache_size))
