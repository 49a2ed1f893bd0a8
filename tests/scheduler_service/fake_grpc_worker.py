"""A worker that attaches to the real scheduler over the real plan stream, backed by the scheduler tests'
FakeWorker (its tokens depend only on each request's history, so schedule changes can't change them)."""

from __future__ import annotations

import asyncio

import grpc

from steploop.common import grpc_options
from steploop.common.pb.steploop.v1 import worker_pb2, worker_pb2_grpc
from steploop.common.step_contract import StepPlan, WorkerInfo
from tests.scheduler.sched_factories import EOS, FakeWorker


class FakeGrpcWorker:
    def __init__(self, address: str, num_kv_blocks: int = 256, block_size: int = 4, max_model_len: int = 512,
                 step_delay: float = 0.0, worker_id: str = "fake-0"):
        self.address = address
        self.info = WorkerInfo(worker_id=worker_id, model_name="fake-model", block_size=block_size,
                               num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, vocab_size=1000,
                               eos_token_ids=(EOS,))
        self.worker = FakeWorker(block_size=block_size)
        self.step_delay = step_delay
        self.paused = asyncio.Event()
        self.paused.set()                       # cleared = hung (steps stall)
        self.steps = 0
        self.task: asyncio.Task | None = None
        self.call = None
        self.controls: list = []                # EngineControl messages received (weights_load, weights_swap)
        self.load_error = ""                    # set: weights_load answers with this error
        self.plans: list[StepPlan] = []

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.address, options=grpc_options.CLIENT) as channel:
            # wait_for_ready: a first connect that fails on a loaded machine is retried, not the end of the worker
            call = self.call = worker_pb2_grpc.PlanStreamStub(channel).Attach(wait_for_ready=True)
            await call.write(worker_pb2.WorkerMessage(hello=self.info.to_pb()))
            async for msg in call:
                if msg.HasField("control"):
                    await call.write(worker_pb2.WorkerMessage(control_result=self._control(msg.control)))
                    continue
                await self.paused.wait()
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                plan = StepPlan.from_pb(msg.plan)
                self.plans.append(plan)
                result = self.worker.execute(plan)
                self.steps += 1
                await call.write(worker_pb2.WorkerMessage(result=result.to_pb()))

    def _control(self, control: worker_pb2.EngineControl) -> worker_pb2.ControlResult:
        self.controls.append(control)
        error = self.load_error if control.HasField("weights_load") else ""
        return worker_pb2.ControlResult(control_id=control.control_id, error=error)

    def start(self) -> "FakeGrpcWorker":
        self.task = asyncio.create_task(self._run())
        return self

    def alive(self) -> bool:
        """False once the worker's stream task has ended; if it ended with an error, that error is raised here so
        a wait for the worker names why it never attached instead of timing out."""
        if self.task is None or not self.task.done():
            return True
        if not self.task.cancelled() and self.task.exception() is not None:
            raise self.task.exception()
        return False

    async def kill(self) -> None:
        # Cancel the call itself (RST_STREAM, as a dead process's closed socket is seen at once); cancelling the
        # task alone can leave the scheduler to find the stream dead by keepalive, 5-10 s later.
        if self.call is not None:
            self.call.cancel()
        self.task.cancel()
        try:
            await self.task
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
