"""WorkerLink: the scheduler's end of one worker's plan stream (PlanStream.Attach).

The worker opened the stream and sent its hello; the step loop then calls `step(plan)` once per step: one
StepPlan written, one StepResult read, in order. A broken stream surfaces as WorkerLost, which the loop treats
as preemption of everything that worker held.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common.pb.steploop.v1 import worker_pb2
from services.common.step_contract import StepPlan, StepResult, WorkerInfo


class WorkerLost(Exception):
    """The worker's stream broke (it died, restarted, or the link was cut)."""


class WorkerLink:
    def __init__(self, context: grpc.aio.ServicerContext, info: WorkerInfo):
        self.context = context
        self.info = info
        self.attached_at = time.monotonic()
        self.closed = asyncio.Event()       # set when the stream is known to be broken
        self.bytes_sent = 0

    async def step(self, plan: StepPlan) -> StepResult:
        if self.closed.is_set():
            raise WorkerLost(f"worker {self.info.worker_id} is gone")
        msg = worker_pb2.SchedulerMessage(plan=plan.to_pb())
        try:
            await self.context.write(msg)
            self.bytes_sent += msg.ByteSize()
            reply = await self._read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError) as exc:
            self.close()
            raise WorkerLost(f"worker {self.info.worker_id}: {exc}") from exc
        if reply is grpc.aio.EOF or reply is None or not reply.HasField("result"):
            self.close()
            raise WorkerLost(f"worker {self.info.worker_id} closed its stream")
        result = StepResult.from_pb(reply.result)
        if result.step_id != plan.step_id:
            self.close()
            raise WorkerLost(f"worker answered step {result.step_id} to plan {plan.step_id}")
        return result

    async def _read(self):
        """The next message, or None as soon as the stream is known to be closed (a pending read alone can hang)."""
        read = asyncio.ensure_future(self.context.read())
        closed = asyncio.ensure_future(self.closed.wait())
        done, _ = await asyncio.wait([read, closed], return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        if read in done:
            return read.result()
        read.cancel()
        return None

    def close(self) -> None:
        self.closed.set()
