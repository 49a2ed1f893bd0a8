"""SessionStream: the gateway's requests multiplexed on one Engine.Session stream to the scheduler.

One bidirectional call carries every request of this gateway, as vLLM's frontends share one socket to their engine
core: requests and aborts go out in order through one writer task, and one reader task hands each SessionChunk to
the queue of the request it names. The scheduler sends one message per step for all of them, instead of one per
request per step (the per-token gRPC cost was most of what the split into services cost on two cores). A broken
stream fails every request live on it, as their own calls would have failed; the next request opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.gateway import errors

logger = logging.getLogger(__name__)


class SessionStream:
    """One Session call. Create it inside the running event loop; `open` requests while `closed` is False."""

    def __init__(self, stub):
        self._call = stub.Session()
        self._outbox: asyncio.Queue[engine_pb2.SessionRequest] = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._failure: Callable[[], errors.APIError] | None = None   # set once the call has ended
        self._writer = asyncio.create_task(self._write(), name="engine-session-writer")
        self._reader = asyncio.create_task(self._read(), name="engine-session-reader")

    @property
    def closed(self) -> bool:
        return self._failure is not None

    def open(self, request: engine_pb2.GenerateRequest, traceparent: str = "") -> asyncio.Queue:
        """Sends the request; its SessionChunks, then an APIError factory if the stream breaks first, arrive on
        the returned queue. An id already live here is refused (its chunks could not be told apart)."""
        if self._failure is not None:
            raise self._failure()
        if request.request_id in self._queues:
            raise errors.bad_request(f"request id {request.request_id!r} is already live", param="request_id",
                                     code="duplicate_request_id")
        queue = self._queues[request.request_id] = asyncio.Queue()
        self._outbox.put_nowait(engine_pb2.SessionRequest(generate=request, traceparent=traceparent))
        return queue

    def close(self, request_id: str, *, abort: bool) -> None:
        """The caller is done with the request; abort=True tells the scheduler to drop it (no await: this runs
        while a cancelled HTTP handler unwinds)."""
        self._queues.pop(request_id, None)
        if abort and not self.closed:
            self._outbox.put_nowait(engine_pb2.SessionRequest(abort=engine_pb2.AbortRequest(request_ids=[request_id])))

    def evict(self, failure: Callable[[], errors.APIError]) -> int:
        """Ends every request live here with `failure` (its replica stopped serving: migration.py moves them);
        the scheduler is told to drop them, and chunks that still come for them are dropped. Returns how many."""
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(failure)
        if queues and not self.closed:
            self._outbox.put_nowait(engine_pb2.SessionRequest(abort=engine_pb2.AbortRequest(request_ids=list(queues))))
        return len(queues)

    def cancel(self) -> None:
        self._call.cancel()

    async def _write(self) -> None:
        try:
            while True:
                await self._call.write(await self._outbox.get())
        except asyncio.CancelledError:
            raise
        except Exception as err:   # noqa: BLE001 - the call ended (the reader reports why) or never started
            logger.debug("engine session: write failed: %r", err)
            self._call.cancel()

    async def _read(self) -> None:
        failure: Callable[[], errors.APIError] = lambda: errors.engine_unavailable("the engine session closed")
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                for entry in message.chunks:
                    queue = self._queues.get(entry.request_id)
                    if queue is not None:   # else: a request its caller already left
                        queue.put_nowait(entry)
        except grpc.aio.AioRpcError as err:
            failure = lambda e=err: errors.from_grpc_error(e)   # one fresh APIError per request
        except asyncio.CancelledError:
            pass   # read() raises this when the call was cancelled here (EngineClient.close, a failed write)
        finally:
            self._failure = failure
            self._writer.cancel()
            for queue in self._queues.values():
                queue.put_nowait(failure)
            self._queues.clear()
