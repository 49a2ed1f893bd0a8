"""EngineControl: pause, resume and weight updates for training loops, between steps of the EngineLoop.

    pause(abort)  every live request ends now (FINISH_REASON_ABORT); nothing runs until resume
    pause(wait)   requests live at the pause run to their end, then nothing runs; returns once they ended
    pause(keep)   at the next step boundary every running request is preempted (the worker drops it; it is
                  recomputed on resume, its outputs kept) and the prefix cache is cleared (KV event
                  AllBlocksCleared); nothing runs until resume
    resume()      held requests join the queue; stepping goes on
    sleep(level)  as pause(keep), then every rank frees its KV cache (level 1) and its weights too (level 2);
    wake_up()     every rank allocates again (reloads its weights after level 2), then resume()
    update_weights_from_disk(path)   at a step boundary: every rank loads the checkpoint beside its weights
                  (shapes checked); if any rank refuses, all drop it and the old weights keep serving; else running
                  requests are preempted, the prefix cache cleared, and every rank switches
    update_weights_*(..., stage_only=True)   the first half only: loaded beside and kept staged (old weights
                  serve on); switch_weights(commit) then switches every rank to them, or drops them. A router
                  updating several replicas stages on all of them before it commits any (routing/router.py).

While paused, requests that arrive are held here (not scheduled; counted as waiting) until resume. Operations that
need a step boundary are queued; the loop stops sending plans, waits for those in flight, and runs them
(`run_pending`) before the next plan. A group lost meanwhile fails them with UnavailableError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from steploop.common.engine_control import PAUSE_MODES, ControlState
from steploop.common.errors import InvalidRequestError, UnavailableError
from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.scheduler.request import Request
from steploop.scheduler.worker_group import WorkerGroup
from steploop.scheduler.worker_link import WorkerLost

if TYPE_CHECKING:
    from steploop.scheduler.engine_loop import EngineLoop

log = logging.getLogger(__name__)
Op = Callable[[WorkerGroup | None], Awaitable[ControlState]]


class EngineControl:
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.paused = False        # new requests are held
        self.frozen = False        # no step runs (pause abort/keep at once; wait once its requests ended)
        self.held: list[Request] = []
        self.weight_version = "0"
        self.weight_updates = 0
        self.sleep_level = 0       # 1 or 2 while the workers' memory is freed (sleep)
        self.staged: tuple[WorkerGroup, str, str] | None = None   # (group holding staged weights, source, folder)
        self.weights_path: str | None = None   # the served weights' folder after updates from disk (None: collective)
        self._ops: deque[tuple[Op, asyncio.Future]] = deque()
        self._changed = asyncio.Event()   # a live request ended (pause(wait) re-checks)

    # ---- what the loop asks ------------------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        return bool(self._ops)

    def hold(self, request: Request) -> bool:
        if self.paused:
            self.held.append(request)
        return self.paused

    def drop(self, request_id: str) -> None:
        self.held = [r for r in self.held if r.request_id != request_id]

    def request_ended(self) -> None:
        self._changed.set()

    def state(self, **counts: int) -> ControlState:
        return ControlState(paused=self.paused, weight_version=self.weight_version,
                            weight_updates=self.weight_updates, sleep_level=self.sleep_level,
                            weights_staged=self.staged is not None, **counts)

    # ---- the RPCs ----------------------------------------------------------------------------------------------
    async def pause(self, mode: str) -> ControlState:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode must be one of {', '.join(PAUSE_MODES)}", param="mode")
        self.paused = True
        if mode == "abort":
            self.frozen = True
            live = [rid for rid in self.loop.streams if rid not in {r.request_id for r in self.held}]
            for request_id in live:
                self.loop.abort(request_id, "paused")
            log.info("paused (abort): %d requests aborted", len(live))
            return self.state(num_aborted=len(live))
        if mode == "wait":
            if self.frozen:               # already paused (abort/keep): what is live stays as it is
                return self.state()
            while self._live_unheld():
                self._changed.clear()
                await self._changed.wait()
                if not self.paused:       # resumed meanwhile: nothing to freeze
                    return self.state()
            self.frozen = True
            log.info("paused (wait): every request live at the pause has ended")
            return self.state()
        self.frozen = True
        return await self._at_boundary(self._keep)

    async def resume(self) -> ControlState:
        if self.sleep_level:
            raise InvalidRequestError(f"the engine is asleep (level {self.sleep_level}): POST /wake_up resumes it",
                                      code="engine_asleep")
        self.paused = self.frozen = False
        self._changed.set()               # a pause(wait) still waiting returns
        held, self.held = self.held, []
        for request in held:
            self.loop.admit_held(request)
        self.loop.wake()
        log.info("resumed: %d held requests queued", len(held))
        return self.state()

    async def update_weights_from_disk(self, path: str, version: str, stage_only: bool = False) -> ControlState:
        load = worker_pb2.EngineControl(weights_load=worker_pb2.WeightsLoad(model_path=path))
        return await self._update(load, version, f"from {path}", "model_path", stage_only, path)

    async def init_weights_update_group(self, request) -> ControlState:
        """Every rank joins the trainer's gloo group (blocks, at a step boundary, until the trainer formed it)."""
        async def join(group: WorkerGroup | None) -> ControlState:
            if group is None:
                raise UnavailableError("no worker is attached to join the group; retry once one is")
            errors = await self._on_ranks(group, worker_pb2.EngineControl(
                weights_group_join=worker_pb2.WeightsGroupJoin(group=request)))
            if errors:
                raise InvalidRequestError(f"joining the weight-update group failed: {errors[0]}",
                                          param="master_address")
            return self.state()
        return await self._at_boundary(join)

    async def update_weights_from_distributed(self, buckets, version: str, stage_only: bool = False) -> ControlState:
        receive = worker_pb2.EngineControl(weights_receive=worker_pb2.WeightsReceive(buckets=buckets))
        return await self._update(receive, version, "from the weight-update group", "buckets", stage_only, "")

    async def _update(self, prepare: worker_pb2.EngineControl, version: str, source: str,
                      param: str, stage_only: bool, path: str) -> ControlState:
        """Two phases on every rank: `prepare` (load or receive, staged beside the served weights), then commit on
        all ranks, or drop on all if any rank refused. stage_only: the commit waits for switch_weights."""
        self._check_awake(param)

        async def update(group: WorkerGroup | None) -> ControlState:
            if group is None:
                raise UnavailableError("no worker is attached to load the weights; retry once one is")
            self.staged = None            # a new load replaces what was staged
            errors = await self._on_ranks(group, prepare)
            if errors:
                await self._drop_staged(group)
                raise InvalidRequestError(f"weights {source} refused, the old weights keep serving: {errors[0]}",
                                          param=param, code="invalid_checkpoint")
            if stage_only:
                self.staged = (group, source, path)
                log.info("weights %s staged on every rank (the old weights serve until switch_weights)", source)
                return self.state()
            return await self._switch(group, version, source, path)
        return await self._at_boundary(update)

    async def switch_weights(self, commit: bool, version: str) -> ControlState:
        """The second half of a stage_only update: every rank serves the staged weights (commit) or drops them."""
        self._check_awake("commit")

        async def switch(group: WorkerGroup | None) -> ControlState:
            staged, self.staged = self.staged, None
            if staged is None or group is None or staged[0] is not group:
                raise InvalidRequestError("no weights are staged on the attached worker group (none was, or the "
                                          "group that staged them was lost): stage them again",
                                          param="commit", code="no_staged_weights")
            if not commit:
                await self._drop_staged(group)
                log.info("staged weights %s dropped; the old weights serve on", staged[1])
                return self.state()
            return await self._switch(group, version, staged[1], staged[2])
        return await self._at_boundary(switch)

    async def _switch(self, group: WorkerGroup, version: str, source: str, path: str) -> ControlState:
        preempted = await self._preempt_running(group)
        errors = await self._on_ranks(group, worker_pb2.EngineControl(
            weights_swap=worker_pb2.WeightsSwap(commit=True)))
        if errors:      # a rank could not switch: the group's ranks differ now, so it must not serve on
            group.close(f"weight switch failed on a rank: {errors[0]}")
            raise WorkerLost(group.close_reason)
        self.weight_updates += 1
        self.weight_version = version or str(self.weight_updates)
        self.weights_path = path or None
        log.info("weights updated %s: version %s, %d running requests preempted", source,
                 self.weight_version, preempted)
        return self.state(num_preempted=preempted)

    async def _drop_staged(self, group: WorkerGroup) -> None:
        await self._on_ranks(group, worker_pb2.EngineControl(weights_swap=worker_pb2.WeightsSwap(commit=False)))

    def _check_awake(self, param: str) -> None:
        if self.sleep_level:
            raise InvalidRequestError("the engine is asleep: POST /wake_up first", param=param,
                                      code="engine_asleep")

    async def sleep(self, level: int) -> ControlState:
        """Pauses as keep does, then every rank frees memory (level 1: its KV cache; 2: its weights too)."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}", param="level")
        if self.sleep_level:
            if self.sleep_level != level:
                raise InvalidRequestError(f"the engine is asleep at level {self.sleep_level}; POST /wake_up first",
                                          param="level", code="engine_asleep")
            return self.state()
        self.paused = self.frozen = True

        async def sleep(group: WorkerGroup | None) -> ControlState:
            if group is None:
                raise UnavailableError("no worker is attached to put to sleep; retry once one is")
            preempted = await self._preempt_running(group)
            answers = await group.control(worker_pb2.EngineControl(sleep=worker_pb2.Sleep(level=level)))
            errors = group.control_errors(answers)
            if errors:                    # whoever slept wakes again: the group stays whole and paused
                await group.control(worker_pb2.EngineControl(wake_up=worker_pb2.WakeUp()))
                raise InvalidRequestError(f"sleep refused: {errors[0]}", param="level")
            self.sleep_level = level
            log.info("asleep (level %d): %d running requests preempted; worker RSS %s MiB", level, preempted,
                     [a.rss_bytes >> 20 for a in answers])
            return self.state(num_preempted=preempted, worker_rss_bytes=tuple(a.rss_bytes for a in answers))
        return await self._at_boundary(sleep)

    async def wake_up(self) -> ControlState:
        """Every rank allocates again (and reloads its weights after level 2); then generation resumes."""
        if not self.sleep_level:
            return self.state()

        async def wake(group: WorkerGroup | None) -> ControlState:
            rss: tuple[int, ...] = ()
            if group is not None:         # none: the next group attaches awake
                answers = await group.control(worker_pb2.EngineControl(wake_up=worker_pb2.WakeUp()))
                errors = group.control_errors(answers)
                if errors:                # a rank that cannot wake must not serve: its restart recovers it
                    group.close(f"a rank could not wake up: {errors[0]}")
                    raise WorkerLost(group.close_reason)
                rss = tuple(a.rss_bytes for a in answers)
            self.sleep_level = 0
            log.info("awake; worker RSS %s MiB", [r >> 20 for r in rss])
            return self.state(worker_rss_bytes=rss)
        woke = await self._at_boundary(wake)
        await self.resume()
        return dataclasses.replace(woke, paused=False)

    def restore_on_attach(self) -> None:
        """A group that attaches after weight updates was started with its launch weights: before its first step
        it loads the served ones (the last update's folder), or, if it cannot, it is closed (it must not serve other
        weights under this version). After an update over the collective group, which no folder holds, the version
        goes back to the launch weights' ("0"), with a warning, so nothing reports weights it does not serve."""
        if not self.weight_updates or self.weight_version == "0":
            return

        async def restore(group: WorkerGroup | None) -> ControlState:
            if group is None:
                return self.state()
            if self.weights_path is None:
                log.warning("a new worker group serves the launch weights: weight version %s (received over the "
                            "weight-update group) is gone with the old one; version is '0' until the next update",
                            self.weight_version)
                self.weight_version = "0"
                return self.state()
            errors = await self._on_ranks(group, worker_pb2.EngineControl(
                weights_load=worker_pb2.WeightsLoad(model_path=self.weights_path)))
            if errors:
                await self._drop_staged(group)
            else:
                errors = await self._on_ranks(group, worker_pb2.EngineControl(
                    weights_swap=worker_pb2.WeightsSwap(commit=True)))
            if errors:
                group.close(f"the new worker group cannot load the served weights (version {self.weight_version} "
                            f"from {self.weights_path}): {errors[0]}")
                raise WorkerLost(group.close_reason)
            log.info("new worker group loaded the served weights: version %s from %s", self.weight_version,
                     self.weights_path)
            return self.state()
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())   # nobody awaits it: the log says
        self._ops.appendleft((restore, future))       # before anything queued for the old group
        self.loop.wake()

    # ---- between steps -----------------------------------------------------------------------------------------
    async def _at_boundary(self, op: Op) -> ControlState:
        future = asyncio.get_running_loop().create_future()
        self._ops.append((op, future))
        self.loop.wake()
        return await future

    async def run_pending(self, group: WorkerGroup | None) -> None:
        """Runs the queued operations (the loop calls it with no plan outstanding). WorkerLost fails the one that
        met it and every one after, then propagates (the loop loses the group)."""
        while self._ops:
            op, future = self._ops.popleft()
            try:
                result = await op(group)
            except WorkerLost as exc:
                _fail(future, UnavailableError(f"the worker group was lost: {exc}"))
                while self._ops:
                    _fail(self._ops.popleft()[1], UnavailableError(f"the worker group was lost: {exc}"))
                raise
            except Exception as exc:  # noqa: BLE001 - the caller gets it (an EngineError maps to its status)
                _fail(future, exc)
            else:
                if not future.done():
                    future.set_result(result)

    async def _keep(self, group: WorkerGroup | None) -> ControlState:
        preempted = await self._preempt_running(group)
        log.info("paused (keep): %d running requests preempted, prefix cache cleared", preempted)
        return self.state(num_preempted=preempted)

    async def _preempt_running(self, group: WorkerGroup | None) -> int:
        """Every running request preempted and the prefix cache cleared; the worker hears it in one plan."""
        scheduler = self.loop.scheduler
        if scheduler is None:
            return 0
        count = scheduler.num_running
        plan = scheduler.preempt_running()
        if group is not None:
            await self.loop.step_now(group, plan)
        elif self.loop.kv_events is not None:
            self.loop.kv_events.flush()
        return count

    async def _on_ranks(self, group: WorkerGroup, message: worker_pb2.EngineControl) -> list[str]:
        return group.control_errors(await group.control(message))

    def _live_unheld(self) -> bool:
        held = {r.request_id for r in self.held}
        return any(rid not in held for rid in self.loop.streams)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
