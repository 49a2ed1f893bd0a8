"""EngineSession: one caller's requests multiplexed on one Engine.Session stream.

The caller writes GenerateRequests and aborts; the step loop puts each request's outputs into this session's
outbox (through a SessionSink), and one writer sends everything pending as one SessionOutputs message, so a step
costs the session one message however many of its requests it advanced. Requests still live when the stream ends
(the caller went away, or cancelled it) are aborted; a request that fails ends with its error in a SessionChunk
and the stream goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from steploop.common import tracing
from steploop.common.engine_contract import EngineRequest
from steploop.common.errors import (
    RETRY_AFTER_KEY,
    EngineError,
    InvalidRequestError,
    trailing_metadata,
)
from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.scheduler.engine_loop import EngineLoop
from steploop.scheduler.request_stream import FailedOutput, is_final, merge

MESSAGE_BYTES = 4 * 1024 * 1024   # a step's outputs are split into messages of about this size at most


class SessionSink:
    """What EngineLoop.streams holds for a session's request: its outputs go to the session's outbox."""
    __slots__ = ("detached", "request_id", "session")

    def __init__(self, request_id: str, session: EngineSession):
        self.request_id, self.session, self.detached = request_id, session, False

    def put(self, output) -> None:
        if not self.detached:   # the caller aborted it: nobody is waiting for the last chunk
            self.session.put(self.request_id, output)


class EngineSession:
    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.live: dict[str, SessionSink] = {}     # accepted and not yet finished
        self.pending: dict[str, list] = {}         # request id -> outputs not sent yet, oldest first
        self.ready = asyncio.Event()
        self.reading = True

    def put(self, request_id: str, output) -> None:
        self.pending.setdefault(request_id, []).append(output)
        if is_final(output):
            self.live.pop(request_id, None)
        self.ready.set()

    async def serve(self, requests: AsyncIterator[engine_pb2.SessionRequest], write) -> None:
        """Until the caller stops sending and every request it sent has finished; aborts the rest on the way out
        (cancellation included)."""
        reader = asyncio.create_task(self._read(requests))
        try:
            await self._write_loop(write)
            await reader   # surfaces a reader failure
        finally:
            reader.cancel()
            for request_id, sink in list(self.live.items()):
                sink.detached = True
                self.loop.abort(request_id, "session_closed")
            self.live.clear()

    async def _read(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "generate":
                    self._add(message.generate, message.traceparent)
                elif kind == "abort":
                    self._abort(message.abort.request_ids)
        finally:
            self.reading = False
            self.ready.set()

    def _add(self, request: engine_pb2.GenerateRequest, traceparent: str) -> None:
        request_id = request.request_id
        try:
            if not request_id:
                raise InvalidRequestError("a Session request needs a request_id", param="request_id")
            if request_id in self.live:   # ambiguous from here on: end both, the caller sees one error
                self._abort([request_id])
                raise InvalidRequestError(f"request id {request_id!r} is already live on this session",
                                          param="request_id", code="duplicate_request_id")
            with tracing.traceparent_context(traceparent):
                self.loop.add_request(EngineRequest.from_pb(request), self._sink)
        except EngineError as err:
            self.put(request_id, FailedOutput(request_id, err))

    def _sink(self, request_id: str) -> SessionSink:
        sink = self.live[request_id] = SessionSink(request_id, self)
        return sink

    def _abort(self, request_ids) -> None:
        for request_id in request_ids:
            sink = self.live.pop(request_id, None)
            self.pending.pop(request_id, None)
            if sink is not None:
                sink.detached = True
                self.loop.abort(request_id, "cancelled")

    async def _write_loop(self, write) -> None:
        while True:
            if not self.pending:
                if not self.reading and not self.live:
                    return
                self.ready.clear()
                await self.ready.wait()
                continue
            pending, self.pending = self.pending, {}
            for message in outputs_messages(pending):
                await write(message)


def outputs_messages(pending: dict[str, list], max_bytes: int = MESSAGE_BYTES) -> list[engine_pb2.SessionOutputs]:
    """One message for everything pending, or several when prompt logprobs make it large: each stays under
    max_bytes unless a single request's chunk is larger (gRPC's own limit is 64 MiB)."""
    messages = [engine_pb2.SessionOutputs()]
    size = 0
    for request_id, outputs in pending.items():
        chunks = messages[-1].chunks
        entry = chunks.add(request_id=request_id)
        _fill(entry, outputs)
        entry_size = entry.ByteSize()
        if size and size + entry_size > max_bytes:     # rare: move it to a message of its own
            messages.append(engine_pb2.SessionOutputs(chunks=[entry]))
            del chunks[-1]
            size = 0
        size += entry_size
    return messages


def _fill(entry: engine_pb2.SessionChunk, outputs: list) -> None:
    """The request's outputs merged into one chunk, or its error (what Generate would end its call with)."""
    try:
        merge(outputs).to_pb(entry.chunk)
    except EngineError as err:
        entry.ClearField("chunk")
        entry.error.status_code = err.grpc_status.value[0]
        entry.error.message = err.message
        entry.error.code = err.code
        entry.error.param = err.param or ""
        entry.error.retry_after_s = int(dict(trailing_metadata(err)).get(RETRY_AFTER_KEY, 0))
