"""WorkerLink: the scheduler's end of one worker's (one rank's) plan stream (PlanStream.Attach).

The worker opened the stream and sent its hello. The Attach handler then runs `read_loop`, which always has a
read pending, so a worker that dies or is cut off is noticed at once, busy or idle. The step loop drives links
only through their WorkerGroup (worker_group.py; a single worker is a group of one), which writes one serialized
StepPlan per step (`send_bytes`) and `recv`s the StepResults in the same order. With async scheduling two plans
are outstanding: the worker finds plan N+1 queued when it finishes N, so it never waits for a network round trip.
A broken stream surfaces as WorkerLost, which the loop treats as preemption of everything that worker held.

Plans go out as bytes serialized once (`encode_plan`), so a tensor-parallel group writes the same bytes to every
rank; the PlanStream handler is registered with a serializer that passes bytes through.
Closing a link ends its Attach call (the worker sees the stream end and re-attaches).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from steploop.common.pb.steploop.v1 import worker_pb2
from steploop.common.step_contract import StepPlan, StepResult, WorkerInfo

log = logging.getLogger(__name__)


class WorkerLost(Exception):
    """The worker's stream broke (it died, restarted, or the link was cut)."""


def encode_plan(plan: StepPlan) -> bytes:
    return worker_pb2.SchedulerMessage(plan=plan.to_pb()).SerializeToString()


def _serialize(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_plan_stream_servicer(servicer, server: grpc.aio.Server) -> None:
    """worker_pb2_grpc.add_PlanStreamServicer_to_server, except that pre-serialized bytes are written as-is."""
    handler = grpc.stream_stream_rpc_method_handler(servicer.Attach,
                                                    request_deserializer=worker_pb2.WorkerMessage.FromString,
                                                    response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("steploop.v1.PlanStream",
                                                                          {"Attach": handler}),))


class WorkerLink:
    def __init__(self, context: grpc.aio.ServicerContext, info: WorkerInfo):
        self.context = context
        self.info = info
        self.attached_at = time.monotonic()
        self.closed = asyncio.Event()       # set when the stream is known to be broken
        self.close_reason = ""
        self.ended_by_stop = False          # closed by the scheduler's own stop: an ordered stop, not a fault
        self.bytes_sent = 0
        self._results: asyncio.Queue[worker_pb2.StepResult] = asyncio.Queue()
        self._controls: asyncio.Queue[worker_pb2.ControlResult] = asyncio.Queue()   # engine_control.py's answers

    async def read_loop(self) -> None:
        """Reads results until the stream ends; run by the Attach handler for the stream's whole life."""
        closed = asyncio.ensure_future(self.closed.wait())   # close() ends the call, not only the next read
        try:
            while not self.closed.is_set():
                read = asyncio.ensure_future(self.context.read())
                await asyncio.wait([read, closed], return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    return
                msg = read.result()
                if msg is grpc.aio.EOF:
                    self.close("the worker closed its stream")
                elif msg.HasField("result"):
                    self._results.put_nowait(msg.result)
                elif msg.HasField("control_result"):
                    self._controls.put_nowait(msg.control_result)
                else:
                    log.warning("worker %s sent an unexpected %s", self.info.worker_id, msg.WhichOneof("kind"))
        except asyncio.CancelledError:
            self.close("stream cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - any transport failure means the same: the worker is gone
            self.close(f"stream failed: {exc}")
        finally:
            closed.cancel()

    async def send_bytes(self, data: bytes | worker_pb2.SchedulerMessage) -> None:
        """Writes one SchedulerMessage, given serialized (a plan) or as a message (a group's TpGroupForm)."""
        if self.closed.is_set():
            raise WorkerLost(self.close_reason)
        try:
            await self.context.write(data)
        except Exception as exc:  # noqa: BLE001 - grpc raises several unrelated types for a dead stream
            self.close(f"write failed: {exc}")
            raise WorkerLost(self.close_reason) from exc
        self.bytes_sent += len(data) if isinstance(data, bytes) else data.ByteSize()

    async def recv(self, plan: StepPlan) -> StepResult:
        """The result of `plan`, the oldest plan sent and not yet answered (the worker answers in order)."""
        return StepResult.from_pb(await self.recv_raw(plan))

    async def recv_control(self, control_id: int) -> worker_pb2.ControlResult:
        """The worker's answer to EngineControl `control_id` (sent with no plan outstanding)."""
        result = await self._next(self._controls)
        if result.control_id != control_id:
            self.close(f"worker answered control {result.control_id} to control {control_id}")
            raise WorkerLost(self.close_reason)
        return result

    async def _next(self, queue: asyncio.Queue):
        """The next message of `queue`, or WorkerLost once the stream is known broken."""
        if queue.empty():
            get = asyncio.ensure_future(queue.get())
            closed = asyncio.ensure_future(self.closed.wait())
            try:
                await asyncio.wait([get, closed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                closed.cancel()
                if not get.done():
                    get.cancel()
            if not get.done() or get.cancelled():
                raise WorkerLost(self.close_reason)
            return get.result()
        return queue.get_nowait()

    async def recv_raw(self, plan: StepPlan) -> worker_pb2.StepResult:
        """recv without decoding: a group's other ranks only confirm the step id (and report errors)."""
        result = await self._next(self._results)
        if result.step_id != plan.step_id:
            self.close(f"worker answered step {result.step_id} to plan {plan.step_id}")
            raise WorkerLost(self.close_reason)
        return result

    def close(self, reason: str = "closed") -> None:
        if not self.closed.is_set():
            self.close_reason = f"worker {self.info.worker_id}: {reason}"
            self.closed.set()
