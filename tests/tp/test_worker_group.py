"""The scheduler's side of a tensor-parallel group, with in-memory plan streams: assembly in any order, refusals
naming both values, one serialization written to every rank, and one rank lost = the group lost."""

from __future__ import annotations

import asyncio

import pytest

from steploop.common.errors import InvalidRequestError
from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.common.step_contract import StepPlan, StepResult, WorkerInfo
from steploop.scheduler.worker_group import GroupAssembler
from steploop.scheduler.worker_link import WorkerLink, WorkerLost


class FakeStream:
    """The server side of one Attach call: records what the scheduler writes, replays what the worker sends."""

    def __init__(self):
        self.written: list = []
        self.inbox: asyncio.Queue = asyncio.Queue()

    async def write(self, message) -> None:
        self.written.append(message)

    async def read(self):
        return await self.inbox.get()


def info(rank: int, world: int = 3, **changes) -> WorkerInfo:
    fields = dict(worker_id=f"w{rank}", model_name="m", block_size=16, num_kv_blocks=100 + rank, max_model_len=512,
                  vocab_size=1000, eos_token_ids=(2,), rank=rank, world_size=world, dtype="float32",
                  tp_rendezvous="10.0.0.1:2345" if rank == 0 else "")
    return WorkerInfo(**{**fields, **changes})


def test_mismatched_rank_is_refused_naming_both_values():
    async def scenario():
        assembler = GroupAssembler(3, 30.0)
        assembler.add(WorkerLink(FakeStream(), info(0)))
        with pytest.raises(InvalidRequestError, match=r"rank 1 \(w1\) has dtype 'bfloat16', rank 0 \(w0\) has "
                                                      r"'float32'"):
            assembler.add(WorkerLink(FakeStream(), info(1, dtype="bfloat16")))
        with pytest.raises(InvalidRequestError, match=r"rank 2 \(w2\) has --enable-expert-parallel True, rank 0 "
                                                      r"\(w0\) has False"):   # its experts would count twice
            assembler.add(WorkerLink(FakeStream(), info(2, expert_parallel=True)))
        assert WorkerInfo.from_pb(info(2, expert_parallel=True).to_pb()).expert_parallel    # the hello carries it
        with pytest.raises(InvalidRequestError, match=r"rank 2 \(w2\) has --kv-cache-dtype 'float8_e4m3fn', rank 0 "
                                                      r"\(w0\) has 'float32'"):     # their blocks mean other things
            assembler.add(WorkerLink(FakeStream(), info(2, kv_cache_dtype="float8_e4m3fn")))
        assert WorkerInfo.from_pb(info(2, kv_cache_dtype="float8_e5m2").to_pb()).cache_dtype == "float8_e5m2"
        assert info(2).cache_dtype == "float32"             # unset: the model's dtype
        with pytest.raises(InvalidRequestError, match="started with -tp 2; this scheduler serves -tp 3"):
            assembler.add(WorkerLink(FakeStream(), info(1, world=2)))
    asyncio.run(scenario())


def test_group_forms_in_any_order_and_writes_one_serialization_to_every_rank():
    async def scenario():
        assembler = GroupAssembler(3, 12.5)
        streams = [FakeStream() for _ in range(3)]
        links = [WorkerLink(streams[r], info(r)) for r in range(3)]
        assert assembler.add(links[2]) is None and assembler.add(links[0]) is None
        group = assembler.add(links[1])
        assert group.info.num_kv_blocks == 100                       # the smallest rank's pool
        plan = StepPlan(step_id=7)
        plan.scheduled_handles.append(1)
        plan.num_scheduled_tokens.append(1)
        await group.send(plan)
        for stream in streams:
            form = stream.written[0].tp_group
            assert (form.generation, form.world_size, form.rendezvous, form.collective_timeout_s) == \
                (1, 3, "10.0.0.1:2345", 12.5)
            assert stream.written[1] is streams[0].written[1]          # the very same bytes object
        assert worker_pb2.SchedulerMessage.FromString(streams[0].written[1]).plan.step_id == 7
        for r, link in enumerate(links):
            result = StepResult(step_id=7, sampled={1: [42]} if r == 0 else {})
            link._results.put_nowait(result.to_pb())
        assert (await group.recv(plan)).sampled == {1: [42]}
        assert group.bytes_written == 3 * group.bytes_sent
    asyncio.run(scenario())


def test_one_rank_lost_closes_every_link():
    async def scenario():
        assembler = GroupAssembler(2, 30.0)
        links = [WorkerLink(FakeStream(), info(r, world=2)) for r in range(2)]
        assembler.add(links[0])
        group = assembler.add(links[1])
        plan = StepPlan(step_id=1)
        await group.send(plan)
        links[0]._results.put_nowait(StepResult(step_id=1).to_pb())
        links[1].close("the worker closed its stream")
        with pytest.raises(WorkerLost, match="tensor-parallel group 1"):
            await group.recv(plan)
        assert all(link.closed.is_set() for link in links)
    asyncio.run(scenario())


def test_engine_serves_only_while_the_group_is_whole():
    """EngineLoop: NOT_SERVING until every rank attached; one rank's stream ending detaches the whole group
    (every link closed, so the other ranks' Attach calls end too) and the KV pool is the smallest rank's."""
    from steploop.scheduler.config import SchedulerConfig
    from steploop.scheduler.engine_loop import EngineLoop
    from steploop.scheduler.server_config import ServerConfig

    async def scenario():
        loop = EngineLoop(SchedulerConfig(), ServerConfig(tensor_parallel_size=2))
        links = [WorkerLink(FakeStream(), info(r, world=2)) for r in range(2)]
        loop.attach(links[1])
        assert not loop.is_serving() and loop.group is None
        loop.attach(links[0])
        assert loop.is_serving() and loop.scheduler.kv.num_blocks == 100
        assert loop.load_report().workers_attached == 2
        loop.detach(links[1], "the worker closed its stream")
        assert not loop.is_serving() and loop.group is None and links[0].closed.is_set()
        with pytest.raises(InvalidRequestError, match="started with -tp 1"):
            loop.attach(WorkerLink(FakeStream(), info(0, world=1)))
    asyncio.run(scenario())
