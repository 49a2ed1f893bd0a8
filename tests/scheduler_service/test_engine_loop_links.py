"""EngineLoop against stub worker links (no gRPC), for orderings a real stream only hits by chance: the Attach
handler detaches a dying worker and a new one attaches while the step loop still waits on the old link."""

from __future__ import annotations

import asyncio

import pytest

from steploop.common.engine_contract import EngineRequest
from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult, WorkerInfo
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.engine_loop import EngineLoop
from steploop.scheduler.server_config import ServerConfig
from steploop.scheduler.worker_link import WorkerLost
from tests.scheduler.sched_factories import EOS, FakeWorker
from tests.scheduler_service.test_engine_service import expected

pytestmark = pytest.mark.asyncio


class StubLink:
    """WorkerLink's interface over FakeWorker, answering in order: the loop drives it as a group of one, which
    writes each plan serialized. Like the real link, recv waits for a result or the stream's end, hands out a
    result that arrived before the stream broke, and treats a result for another step as a broken stream. With
    hold_from=n, recv of the n-th plan and later waits until `release()`."""

    def __init__(self, worker_id: str, hold_from: int | None = None):
        self.info = WorkerInfo(worker_id=worker_id, model_name="fake-model", block_size=4, num_kv_blocks=256,
                               max_model_len=512, vocab_size=1000, eos_token_ids=(EOS,))
        self.worker = FakeWorker(block_size=4)
        self.closed, self.close_reason, self.bytes_sent = asyncio.Event(), "", 0
        self.results: asyncio.Queue[StepResult] = asyncio.Queue()
        self.hold_from, self.received = hold_from, 0
        self.held, self._gate = asyncio.Event(), asyncio.Event()
        self.ended_by_stop = False          # as WorkerLink: closed by the scheduler's own stop

    def close(self, reason: str) -> None:
        if not self.closed.is_set():
            self.close_reason = reason
            self.closed.set()

    def release(self) -> None:
        self._gate.set()

    async def send_bytes(self, data: bytes) -> None:
        if self.closed.is_set():
            raise WorkerLost(self.close_reason)
        plan = StepPlan.from_pb(worker_pb2.SchedulerMessage.FromString(data).plan)
        self.results.put_nowait(self.worker.execute(plan))

    async def recv(self, plan: StepPlan) -> StepResult:
        self.received += 1
        if self.hold_from is not None and self.received >= self.hold_from:
            self.held.set()
            await self._gate.wait()
        if self.results.empty():                         # wait for a result or the end of the stream
            get, closed = asyncio.ensure_future(self.results.get()), asyncio.ensure_future(self.closed.wait())
            await asyncio.wait([get, closed], return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
            if not get.done():
                get.cancel()
                raise WorkerLost(self.close_reason)
            result = get.result()
        else:
            result = self.results.get_nowait()
        if result.step_id != plan.step_id:                # the real link checks this too
            self.close(f"worker answered step {result.step_id} to plan {plan.step_id}")
            raise WorkerLost(self.close_reason)
        return result


async def run_to_end(stream) -> list[int]:
    tokens = []
    while not stream.finished:
        tokens.extend((await stream.next_chunk()).token_ids)
    return tokens


async def test_old_link_detached_and_replaced_while_the_loop_awaits_it():
    loop = EngineLoop(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                      ServerConfig(host="127.0.0.1", port=0, worker_timeout=5.0))
    old = StubLink("old", hold_from=4)
    loop.attach(old)
    task = asyncio.create_task(loop.run())
    prompt = [13] * 20
    stream = loop.add_request(EngineRequest("survivor", prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    try:
        await asyncio.wait_for(old.held.wait(), 5)      # the loop waits on `old`, with plans in flight on it
        old.close("stream cancelled")                    # what the Attach handler does when the worker dies...
        loop.detach(old, old.close_reason)
        loop.attach(StubLink("new"))                     # ...and a restarted worker is already back
        old.release()                                    # the old link hands out a result it had queued
        tokens = await asyncio.wait_for(run_to_end(stream), 10)
        assert tokens == expected(prompt, 30)
        assert not task.done()                           # the step loop lives on
    finally:
        task.cancel()
