"""RankLink: one attach of a worker that is a rank of a tensor-parallel group (a no-op at world size 1).

    hello()        rank 0 opens a fresh GroupStore and advertises its address in the WorkerHello
    former(form)   a callable the forward thread runs, in order with the plans: forms the process group
    answer(result) what this rank sends back: rank 0 (-pp: the last stage's tp rank 0) the sampled tokens; the
                   others only the step id (and any error), so the scheduler knows they kept up without paying
                   for the tokens twice. Every
                   LOG_EVERY steps rank 0 logs its time in collectives per step (benchmarks/tp_plan_cost.py)
    leave()        the stream ended: drop the process group and the store (a re-formed group starts fresh)
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta

from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.common.step_contract import StepResult, WorkerInfo
from steploop.gpu_worker import kv_tier_mover
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.distributed.comm import CollectiveError, TensorParallelComm
from steploop.gpu_worker.distributed.process_group import GroupStore, form_group, form_stage_groups

log = logging.getLogger(__name__)
LOG_EVERY = 100


class RankLink:
    def __init__(self, config: WorkerConfig, runner):
        self.config, self.runner = config, runner
        self.comm: TensorParallelComm | None = runner.tp_comm
        self.pipe = getattr(runner, "pipe", None)     # a pipeline stage's PipelineComm (pipeline.py), else None
        self.store: GroupStore | None = None
        self._steps, self._forward, self._collective = 0, 0.0, 0.0

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def hello(self) -> WorkerInfo:
        info = kv_tier_mover.refresh_hello(self.runner.info, getattr(self.runner, "tiers", None))
        if self.world_size > 1 and self.config.rank == 0:
            self.store = GroupStore(self.config.tp_host, self.world_size)
            info = dataclasses.replace(info, tp_rendezvous=self.store.address)
        return info

    def former(self, form: worker_pb2.TpGroupForm):
        def form_now() -> None:
            if form.world_size != self.world_size or self.comm is None:
                raise CollectiveError(f"the scheduler formed a group of {form.world_size}; this worker was "
                                      f"started with -tp {self.world_size}")
            timeout = timedelta(seconds=form.collective_timeout_s or 30.0)
            try:
                if self.pipe is None:
                    group = form_group(self.config.rank, self.world_size, form.rendezvous, form.generation, timeout,
                                       self.config.tp_host, self.runner.device, self.store)
                else:
                    group, whole = form_stage_groups(self.config.rank, self.config.tensor_parallel_size,
                                                     self.config.pipeline_parallel_size, form.rendezvous,
                                                     form.generation, timeout, self.config.tp_host,
                                                     self.runner.device, self.store)
            except Exception as exc:
                raise CollectiveError(f"rank {self.config.rank}: forming group generation {form.generation} at "
                                      f"{form.rendezvous} failed: {exc}") from exc
            if group is not None:
                self.comm.attach(group, form.generation, timeout)
            if self.pipe is not None:
                self.pipe.attach(whole, form.generation, timeout)
        return form_now

    def answer(self, result: StepResult) -> StepResult:
        if self.world_size > 1:
            self._count(result)
        if self.config.rank == self.runner.info.answer_rank:    # rank 0, or the last pipeline stage's tp rank 0
            return result
        return StepResult(step_id=result.step_id, error=result.error, forward_seconds=result.forward_seconds)

    def _count(self, result: StepResult) -> None:
        self._steps += 1
        self._forward += result.forward_seconds
        self._collective += result.collective_seconds
        if self._steps == LOG_EVERY:
            self._log_collectives()

    def _log_collectives(self) -> None:
        log.info("rank %d: collectives %.2f ms/step of %.2f ms/step forward over the last %d steps",
                 self.config.rank, 1e3 * self._collective / self._steps, 1e3 * self._forward / self._steps,
                 self._steps)
        self._steps, self._forward, self._collective = 0, 0.0, 0.0

    def leave(self) -> None:
        if self._steps:
            self._log_collectives()
        if self.comm is not None and self.comm.group is not None:
            log.info("rank %d leaves tensor-parallel group generation %d", self.config.rank, self.comm.generation)
            self.comm.detach()
        if self.pipe is not None and self.pipe.group is not None:
            self.pipe.detach()
        self.store = None
