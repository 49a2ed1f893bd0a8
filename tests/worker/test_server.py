"""The worker attaches to a (fake) scheduler's plan stream, serves plans, and reconnects when it breaks."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from steploop.common.pb.steploop.v1 import worker_pb2, worker_pb2_grpc
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import (
    NewRequestData,
    StepPlan,
    StepResult,
    WorkerInfo,
)
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.server import serve

pytestmark = pytest.mark.slow


class FakeScheduler(worker_pb2_grpc.PlanStreamServicer):
    """Each attach: read hello, send one plan, read its result, then end the stream."""

    def __init__(self):
        self.hellos: list[WorkerInfo] = []
        self.results: list[StepResult] = []

    async def Attach(self, request_iterator, context):
        it = request_iterator.__aiter__()
        self.hellos.append(WorkerInfo.from_pb((await it.__anext__()).hello))
        handle = len(self.hellos)
        plan = StepPlan(step_id=handle, new_requests=[NewRequestData(handle, [1, 2, 3], [], SamplingParams(),
                                                                     [1], 0)],
                        scheduled_handles=[handle], num_scheduled_tokens=[3])
        yield worker_pb2.SchedulerMessage(plan=plan.to_pb())
        self.results.append(StepResult.from_pb((await it.__anext__()).result))


async def test_attach_serve_reconnect(fresh_runner, caplog):
    caplog.set_level(logging.INFO, logger="steploop.worker")
    server = grpc.aio.server()
    fake = FakeScheduler()
    worker_pb2_grpc.add_PlanStreamServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    config = WorkerConfig(scheduler_address=f"127.0.0.1:{port}", num_kv_blocks=256, max_model_len=1024)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, runner=fresh_runner, stop=stop))
    deadline = asyncio.get_running_loop().time() + 30
    while "not reachable yet" not in caplog.text:             # scheduler not up yet: the worker backs off
        assert asyncio.get_running_loop().time() < deadline and not task.done(), "the worker never retried"
        await asyncio.sleep(0.02)
    await server.start()
    for _ in range(200):
        if len(fake.results) >= 2:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 10)
    await server.stop(None)
    assert len(fake.results) >= 2 and fake.hellos[0].num_kv_blocks == 256 and fake.hellos[0].block_size == 16
    assert [r.error for r in fake.results[:2]] == ["", ""]
    assert fake.results[0].sampled[1] and fake.results[1].sampled[2]   # handle 1 was forgotten after detach


class PipelinedScheduler(worker_pb2_grpc.PlanStreamServicer):
    """Sends two plans before reading any result (as the step loop keeps two outstanding), then keeps the stream
    open until the test ends."""

    def __init__(self):
        self.results: list[StepResult] = []
        self.hold = asyncio.Event()

    async def Attach(self, request_iterator, context):
        it = request_iterator.__aiter__()
        await it.__anext__()                                       # hello
        for step in (1, 2):
            plan = StepPlan(step_id=step, new_requests=[NewRequestData(step, [1, 2, 3 + step], [], SamplingParams(),
                                                                       [step], 0)],
                            scheduled_handles=[step], num_scheduled_tokens=[3])
            yield worker_pb2.SchedulerMessage(plan=plan.to_pb())
        for _ in (1, 2):
            self.results.append(StepResult.from_pb((await it.__anext__()).result))
        await self.hold.wait()


async def _serving(fake, runner):
    """A started fake scheduler and a worker serving `runner` attached to it: (server, fake, stop, worker task)."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_PlanStreamServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = WorkerConfig(scheduler_address=f"127.0.0.1:{port}", num_kv_blocks=256, max_model_len=1024)
    stop = asyncio.Event()
    return server, fake, stop, asyncio.create_task(serve(config, runner=runner, stop=stop))


async def test_plans_sent_ahead_are_answered_in_order_and_stop_ends_an_open_stream(fresh_runner):
    server, fake, stop, task = await _serving(PipelinedScheduler(), fresh_runner)
    for _ in range(200):
        if len(fake.results) == 2:
            break
        await asyncio.sleep(0.05)
    assert [(r.step_id, r.error) for r in fake.results] == [(1, ""), (2, "")]
    assert set(fake.results[0].sampled) == {1} and set(fake.results[1].sampled) == {2}
    stop.set()                                                     # the stream is still open: stop must end it
    await asyncio.wait_for(task, 10)
    fake.hold.set()
    await server.stop(None)


class OneAheadScheduler(PipelinedScheduler):
    """Waits for step 1's result with no plan after it (a worker that keeps a step in flight must still answer),
    then sends steps 2 and 3 before reading either: step 3 decodes the token step 2 is still sampling."""

    async def Attach(self, request_iterator, context):
        it = request_iterator.__aiter__()
        await it.__anext__()                                       # hello
        yield worker_pb2.SchedulerMessage(plan=StepPlan(
            step_id=1, new_requests=[NewRequestData(1, [1, 504, 3458], [], SamplingParams(), [1], 0)],
            scheduled_handles=[1], num_scheduled_tokens=[3]).to_pb())
        self.results.append(StepResult.from_pb((await it.__anext__()).result))
        for step in (2, 3):
            plan = StepPlan(step_id=step, scheduled_handles=[1], num_scheduled_tokens=[1])
            plan.cached.append(1, step + 1, [])
            yield worker_pb2.SchedulerMessage(plan=plan.to_pb())
        for _ in (2, 3):
            self.results.append(StepResult.from_pb((await it.__anext__()).result))
        await self.hold.wait()


async def test_a_worker_keeping_a_step_in_flight_answers_every_plan_in_order(fresh_runner, monkeypatch):
    from tests.worker.driver import Driver

    driver = Driver(fresh_runner)
    driver.add(0, [1, 504, 3458], 3)
    want = driver.run(64)[0]
    fresh_runner.reset()
    monkeypatch.setattr(fresh_runner, "keep_in_flight", True)
    server, fake, stop, task = await _serving(OneAheadScheduler(), fresh_runner)
    deadline = asyncio.get_running_loop().time() + 30
    while len(fake.results) < 3:
        assert asyncio.get_running_loop().time() < deadline and not task.done(), fake.results
        await asyncio.sleep(0.02)
    assert [(r.step_id, r.error) for r in fake.results] == [(1, ""), (2, ""), (3, "")]
    assert [r.sampled[1][0] for r in fake.results] == want
    stop.set()
    await asyncio.wait_for(task, 10)
    fake.hold.set()
    await server.stop(None)
