"""A single worker is a WorkerGroup of one rank: the step loop has one path for one worker and for a tensor-parallel
group. A group of one forms no process group (a -tp 1 worker would refuse a TpGroupForm), writes the plan bytes as
they are, and keeps its worker's own words when it closes; the loop attaches, replaces and loses it like any group."""

from __future__ import annotations

import pytest

from steploop.common.engine_contract import EngineRequest
from steploop.common.errors import InvalidRequestError
from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.engine_loop import EngineLoop
from steploop.scheduler.server_config import ServerConfig
from steploop.scheduler.worker_group import GroupAssembler
from steploop.scheduler.worker_link import WorkerLink, WorkerLost
from tests.tp.test_worker_group import FakeStream, info

pytestmark = pytest.mark.asyncio


def one(worker_id: str = "w0", **changes) -> WorkerLink:
    return WorkerLink(FakeStream(), info(0, world=1, worker_id=worker_id, **changes))


async def test_a_single_worker_is_a_group_of_one_that_forms_nothing():
    link = one()
    group = GroupAssembler(1, 30.0).add(link)
    assert group.world_size == 1 and group.info is link.info          # its own name and pool, not "tp-group-1(...)"
    plan = StepPlan(step_id=3)
    await group.send(plan)
    assert len(link.context.written) == 1                               # the plan, no TpGroupForm before it
    assert worker_pb2.SchedulerMessage.FromString(link.context.written[0]).plan.step_id == 3
    assert group.bytes_sent == group.bytes_written == len(link.context.written[0]) == link.bytes_sent
    link._results.put_nowait(StepResult(step_id=3, sampled={1: [7]}).to_pb())
    assert (await group.recv(plan)).sampled == {1: [7]}
    link.close("the worker closed its stream")
    assert group.is_closed
    with pytest.raises(WorkerLost, match=r"^worker w0: the worker closed its stream$"):
        await group.recv(StepPlan(step_id=4))


async def test_a_restarted_worker_replaces_the_attached_one_and_its_requests_are_recomputed():
    loop = EngineLoop(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), ServerConfig())
    old = one("old")
    loop.attach(old)
    assert loop.is_serving() and loop.load_report().workers_attached == 1
    loop.add_request(EngineRequest("r", [5] * 8, SamplingParams(max_tokens=4)))
    plan = loop.scheduler.schedule()                                    # the request now runs on `old`
    assert plan.num_scheduled_tokens == [8] and loop.scheduler.num_running == 1
    new = one("new")
    loop.attach(new)                                                    # before old's stream end is noticed
    assert old.closed.is_set() and old.close_reason == "worker old: replaced by worker new (rank 0)"
    assert loop.group.links == [new] and loop.is_serving()
    assert loop.scheduler.num_running == 0 and loop.scheduler.num_waiting == 1   # preempted, to be recomputed
    loop.detach(old, old.close_reason)                                  # old's Attach handler ends: nothing more
    assert loop.group.links == [new]


async def test_a_worker_of_another_model_is_refused_and_the_attached_one_keeps_serving():
    loop = EngineLoop(SchedulerConfig(), ServerConfig())
    first = one("first")
    loop.attach(first)
    with pytest.raises(InvalidRequestError, match="worker serves 'other', this scheduler serves 'm'"):
        loop.attach(one("second", model_name="other"))
    with pytest.raises(InvalidRequestError, match="started with -tp 2; this scheduler serves -tp 1"):
        loop.attach(WorkerLink(FakeStream(), info(0, world=2)))
    assert loop.group.links == [first] and not first.closed.is_set() and loop.is_serving()


async def test_losing_the_only_worker_is_losing_the_group():
    loop = EngineLoop(SchedulerConfig(), ServerConfig())
    link = one()
    loop.attach(link)
    loop.detach(link, "the worker closed its stream")
    assert loop.group is None and not loop.is_serving() and loop.load_report().workers_attached == 0
    assert loop.lost_since is not None
