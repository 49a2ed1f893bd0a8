"""The worker group the step loop drives: N rank links as one worker. A single worker is a group of one rank.

    GroupAssembler.add(link)  collects ranks as they attach, in any order; refuses a rank whose world size, model,
                              block size, dtype or --enable-expert-parallel differs (naming both values); once
                              all N are in (at once for a single worker), returns a WorkerGroup. A group of several
                              ranks first sends every rank TpGroupForm (rank 0's store address and a new generation
                              number) so they form their process group; a group of one has nothing to form.
    WorkerGroup.send(plan)    serializes the plan ONCE and writes the same bytes to every rank
    WorkerGroup.recv(plan)    every rank's answer to it; rank 0's carries the tokens (with -pp the last stage's
                              tp rank 0's: WorkerInfo.answer_rank), the others' that they kept up

Any rank's link breaking closes the whole group (every link, so the surviving ranks' streams end and they leave
their process group); the step loop sees WorkerLost and preempts everything the group held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from steploop.common.errors import InvalidRequestError
from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.common.step_contract import StepPlan, StepResult, WorkerInfo
from steploop.scheduler.worker_link import WorkerLink, WorkerLost, encode_plan

log = logging.getLogger(__name__)


class WorkerGroup:
    def __init__(self, links: list[WorkerLink], generation: int, collective_timeout: float):
        self.links, self.generation = links, generation
        self.close_reason = ""
        self.bytes_sent = 0           # plan bytes, counted once per plan (each rank gets the same bytes)
        self.bytes_written = 0        # all ranks together
        self._control_id = 0          # engine-control operations sent (engine_control.py)
        rank0 = links[0].info
        self.info, self._formed = rank0, None
        self.answer_rank = rank0.answer_rank
        if self.world_size > 1:       # the ranks' process group; one rank computes alone
            infos = [link.info for link in links]
            on_every_disk = set.intersection(*(set(i.kv_disk_hashes) for i in infos))   # each rank holds its heads
            self.info = dataclasses.replace(rank0, num_kv_blocks=min(i.num_kv_blocks for i in infos),
                                            kv_host_blocks=min(i.kv_host_blocks for i in infos),
                                            kv_disk_blocks=min(i.kv_disk_blocks for i in infos),
                                            kv_disk_hashes=tuple(h for h in rank0.kv_disk_hashes if h in on_every_disk),
                                            worker_id=f"tp-group-{generation}({rank0.worker_id}+{len(links) - 1})")
            form = worker_pb2.TpGroupForm(generation=generation, world_size=len(links),
                                          rendezvous=rank0.tp_rendezvous, collective_timeout_s=collective_timeout)
            self._formed = asyncio.ensure_future(self._send_all(worker_pb2.SchedulerMessage(tp_group=form)))

    @property
    def world_size(self) -> int:
        return len(self.links)

    @property
    def is_closed(self) -> bool:
        return any(link.closed.is_set() for link in self.links)

    async def _send_all(self, data) -> None:
        try:
            for link in self.links:
                await link.send_bytes(data)
        except WorkerLost as exc:
            self.close(str(exc))
            raise WorkerLost(self.close_reason) from exc

    async def send(self, plan: StepPlan) -> None:
        if self._formed is not None:
            await self._formed
        data = encode_plan(plan)
        await self._send_all(data)
        self.bytes_sent += len(data)
        self.bytes_written += len(data) * len(self.links)

    async def recv(self, plan: StepPlan) -> StepResult:
        """Rank by rank: a rank that is lost closes its link, and EngineLoop.detach closes the whole group, so
        waiting on rank 0 first never outlives a dead rank 1."""
        try:
            result = await self.links[self.answer_rank].recv(plan)
            others = [link for rank, link in enumerate(self.links) if rank != self.answer_rank]
            errors = [ack.error for ack in [await link.recv_raw(plan) for link in others] if ack.error]
        except WorkerLost as exc:
            self.close(str(exc))
            raise WorkerLost(self.close_reason) from exc
        if errors and not result.error:      # a rank failed a step the answering rank did not: states diverged
            self.close(f"rank answered step {plan.step_id} with an error rank {self.answer_rank} did not have: "
                       f"{errors[0]}")
            raise WorkerLost(self.close_reason)
        return result

    async def control(self, message: worker_pb2.EngineControl) -> list[worker_pb2.ControlResult]:
        """Sends an engine-control operation to every rank (no plan outstanding) and waits for every rank's
        answer (rank order)."""
        self._control_id += 1
        message.control_id = self._control_id
        await self._send_all(worker_pb2.SchedulerMessage(control=message))
        try:
            answers = [await link.recv_control(self._control_id) for link in self.links]
        except WorkerLost as exc:
            self.close(str(exc))
            raise WorkerLost(self.close_reason) from exc
        return answers

    def control_errors(self, answers: list[worker_pb2.ControlResult]) -> list[str]:
        """The ranks' errors, each prefixed by its rank in a group of several (empty: every rank did it)."""
        return [f"rank {rank}: {a.error}" if self.world_size > 1 else a.error
                for rank, a in enumerate(answers) if a.error]

    def close(self, reason: str = "closed") -> None:
        """Closes every rank's link (their Attach calls end). A group of one keeps its worker's own words."""
        if not self.close_reason:
            self.close_reason = reason if self.world_size == 1 else \
                f"tensor-parallel group {self.generation}: {reason}"
        for link in self.links:
            link.close(reason if self.world_size == 1 else f"its group closed ({reason})")
        if self._formed is not None and not self._formed.done():
            self._formed.cancel()


class GroupAssembler:
    """Ranks attached so far for the next group."""

    def __init__(self, world_size: int, collective_timeout: float, pipeline_parallel_size: int = 1):
        self.pipeline_parallel_size = pipeline_parallel_size
        self.world_size, self.collective_timeout = world_size * pipeline_parallel_size, collective_timeout
        self.pending: dict[int, WorkerLink] = {}
        self.generation = 0

    def add(self, link: WorkerLink) -> WorkerGroup | None:
        """Raises InvalidRequestError for a rank that cannot join; returns the group once all ranks are in."""
        info = link.info
        if info.world_size != self.world_size or info.pipeline_parallel_size != self.pipeline_parallel_size:
            raise InvalidRequestError(f"worker {info.worker_id} was started with "
                                      f"{_sizes(info.world_size, info.pipeline_parallel_size)}; this scheduler "
                                      f"serves {_sizes(self.world_size, self.pipeline_parallel_size)}",
                                      param="world_size")
        if info.rank >= self.world_size:
            raise InvalidRequestError(f"worker {info.worker_id}: rank {info.rank} is not below the group's "
                                      f"{self.world_size} ranks", param="rank")
        for rank, other in self.pending.items():
            if rank != info.rank:
                _check_same(info, other.info)
        old = self.pending.pop(info.rank, None)
        if old is not None:
            log.warning("rank %d: worker %s replaces %s", info.rank, info.worker_id, old.info.worker_id)
            old.close(f"replaced by worker {info.worker_id}")
        self.pending[info.rank] = link
        log.info("rank %d/%d attached (%s); %d of %d ranks in", info.rank, self.world_size, info.worker_id,
                 len(self.pending), self.world_size)
        if len(self.pending) < self.world_size:
            return None
        self.generation += 1
        links = [self.pending[r] for r in range(self.world_size)]
        self.pending = {}
        return WorkerGroup(links, self.generation, self.collective_timeout)

    def discard(self, link: WorkerLink) -> None:
        if self.pending.get(link.info.rank) is link:
            del self.pending[link.info.rank]


def _sizes(world_size: int, pp: int) -> str:
    return f"-tp {world_size // pp}" + (f" -pp {pp}" if pp > 1 else "")


def _check_same(info: WorkerInfo, other: WorkerInfo) -> None:
    for field, what in (("model_name", "model"), ("block_size", "block size"), ("dtype", "dtype"),
                        ("cache_dtype", "--kv-cache-dtype"),
                        ("max_model_len", "max model length"), ("expert_parallel", "--enable-expert-parallel")):
        mine, theirs = getattr(info, field), getattr(other, field)
        if mine != theirs:
            raise InvalidRequestError(f"rank {info.rank} ({info.worker_id}) has {what} {mine!r}, rank "
                                      f"{other.rank} ({other.worker_id}) has {theirs!r}: every rank of a group "
                                      f"must agree", param=field)
