"""EngineClient: the gateway's only door to the scheduler's Engine gRPC service (token ids in, token ids out).

Cancellation is abort: `generate` is an async generator over one request's EngineChunks (the Engine seam's
contract, services/common/engine_contract.py; the generated classes stay in this module and engine_session.py);
closing it (break, aclose,
task cancellation when the HTTP client goes away) aborts the request in the scheduler. By default every request
rides on one shared Session stream (engine_session.py: one message per step for all of them); multiplex=False
gives each request its own Generate call instead. gRPC failures leave this module as `errors.APIError`, mapped
in errors.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from steploop.common import grpc_options, tracing
from steploop.common.engine_contract import EngineChunk, EngineRequest, LoadReport, ModelInfo
from steploop.common.engine_control import PAUSE_MODES, ControlState
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.common.tls import TlsConfig, open_channel
from steploop.gateway import errors
from steploop.gateway import tracing as gateway_tracing
from steploop.gateway.engine.engine_session import SessionStream

logger = logging.getLogger(__name__)

# Message limits and keepalive (a dead scheduler or a silent NAT drop is noticed during long generations).
CHANNEL_OPTIONS = grpc_options.CLIENT
UNARY_TIMEOUT_S = 5.0   # model info, health, abort: cheap calls that must not hang a handler
CONTROL_TIMEOUT_S = 600.0   # pause (wait mode: until live requests end), weight updates (a checkpoint loads)


class EngineClient:
    """Async client for one scheduler replica. Create it inside the running event loop."""

    def __init__(self, address: str, *, channel: grpc.aio.Channel | None = None, tls: TlsConfig | None = None,
                 multiplex: bool = True):
        self.address = address
        self.multiplex = multiplex
        self._channel = channel or open_channel(address, tls or TlsConfig(), CHANNEL_OPTIONS)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._session: SessionStream | None = None
        # Generate calls live (multiplex=False) -> None, or why it was evicted
        self._calls: dict[grpc.aio.Call, Callable[[], errors.APIError] | None] = {}

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Streams the request's chunks; the last one has finish_reason set. Closing the iterator aborts it.
        request_id must be unique among this engine's live requests. pooling set: an embedding request (its
        one chunk carries the vector). resume_output_token_ids: outputs another replica already delivered
        (migration.py); the chunks carry only the tokens after them."""
        params = request.sampling
        span = (gateway_tracing.start_generate(request.request_id, request.prompt_token_ids, params)
                if tracing.ENABLED else None)
        pb = request.to_pb()
        chunks = self._on_session(pb, span) if self.multiplex else self._on_call(pb, span)
        with_logprobs = params.logprobs >= 0 or params.prompt_logprobs >= 0
        try:
            async for pb in chunks:
                chunk = EngineChunk.from_pb(pb, with_logprobs)
                if span is not None and chunk.finish_reason:
                    gateway_tracing.record_finish(span, chunk)
                yield chunk
        finally:
            await chunks.aclose()
            if span is not None:
                span.end()

    async def _on_session(self, request: engine_pb2.GenerateRequest, span) -> AsyncIterator[engine_pb2.GenerateChunk]:
        if self._session is None or self._session.closed:
            self._session = SessionStream(self._stub)
        session = self._session
        queue = session.open(request, tracing.traceparent_of(span) if span is not None else "")
        finished = False
        try:
            while not finished:
                entry = await queue.get()
                if callable(entry):     # the stream broke: the scheduler dropped the request with it
                    finished = True
                    raise entry()
                if entry.HasField("error"):
                    finished = True
                    raise errors.from_request_error(entry.error)
                finished = bool(entry.chunk.finish_reason)
                yield entry.chunk
        finally:
            session.close(request.request_id, abort=not finished)

    async def _on_call(self, request: engine_pb2.GenerateRequest, span) -> AsyncIterator[engine_pb2.GenerateChunk]:
        call = self._stub.Generate(request, metadata=tracing.grpc_metadata(span))
        self._calls[call] = None
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None
        except asyncio.CancelledError:
            failure = self._calls.get(call)
            if failure is None or asyncio.current_task().cancelling():   # cancelled by our caller, not evicted
                raise
            raise failure() from None
        finally:
            self._calls.pop(call, None)
            call.cancel()   # no-op once the stream ended; otherwise the scheduler sees the cancel and aborts

    def evict(self, failure: Callable[[], errors.APIError]) -> int:
        """Ends every request live on this replica with `failure` now (it stopped serving: migration.py moves
        them elsewhere; the scheduler hears each as an abort). Returns how many there were."""
        count = self._session.evict(failure) if self._session is not None else 0
        for call in list(self._calls):
            self._calls[call] = failure
            call.cancel()
        return count + len(self._calls)

    async def abort(self, request_ids: Sequence[str]) -> int:
        try:
            reply = await self._stub.Abort(engine_pb2.AbortRequest(request_ids=list(request_ids)),
                                           timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None
        return reply.num_aborted

    async def metrics_text(self) -> str:
        """The engine's Prometheus metrics (text exposition), for the gateway's /metrics."""
        try:
            return (await self._stub.GetMetrics(engine_pb2.MetricsRequest(), timeout=UNARY_TIMEOUT_S)).text
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None

    async def model_info(self) -> ModelInfo:
        try:
            return ModelInfo.from_pb(await self._stub.GetModelInfo(engine_pb2.ModelInfoRequest(),
                                                                   timeout=UNARY_TIMEOUT_S))
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None

    async def load_report(self) -> LoadReport:
        try:
            return LoadReport.from_pb(await self._stub.GetLoadReport(engine_pb2.LoadReportRequest(),
                                                                     timeout=UNARY_TIMEOUT_S))
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None

    def watch_kv_events(self, from_sequence: int, instance_id: str):
        """The replica's KV events (Engine.WatchKVEvents): a server stream of KvEventMessage, read by
        kv_index.py; gRPC errors are left to it (it tells "events off" from "stream broke")."""
        return self._stub.WatchKVEvents(engine_pb2.KvEventWatchRequest(from_sequence=from_sequence,
                                                                        instance_id=instance_id))
    async def load_lora_adapter(self, name: str, path: str) -> None:
        try:
            await self._stub.LoadLoraAdapter(engine_pb2.LoraAdapterRef(name=name, path=path), timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None

    async def unload_lora_adapter(self, name: str) -> None:
        try:
            await self._stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(name=name),
                                               timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None

    # ---- engine control (the gateway's admin routes) ----
    async def _control(self, method: str, request, timeout: float = CONTROL_TIMEOUT_S) -> ControlState:
        try:
            return ControlState.from_pb(await getattr(self._stub, method)(request, timeout=timeout))
        except grpc.aio.AioRpcError as err:
            raise errors.from_grpc_error(err) from None

    async def pause(self, mode: str) -> ControlState:
        return await self._control("Pause", engine_pb2.PauseRequest(mode=PAUSE_MODES.index(mode)))

    async def resume(self) -> ControlState:
        return await self._control("Resume", engine_pb2.ResumeRequest())

    async def control_state(self) -> ControlState:
        return await self._control("GetEngineControlState", engine_pb2.EngineControlStateRequest(), UNARY_TIMEOUT_S)

    async def update_weights_from_disk(self, model_path: str, weight_version: str = "",
                                       stage_only: bool = False) -> ControlState:
        """stage_only: loaded beside the served weights and kept until switch_weights (engine.proto)."""
        return await self._control("UpdateWeightsFromDisk", engine_pb2.UpdateWeightsFromDiskRequest(
            model_path=model_path, weight_version=weight_version, stage_only=stage_only))

    async def switch_weights(self, commit: bool, weight_version: str = "") -> ControlState:
        """Commits (or drops) the weights a stage_only update staged."""
        return await self._control("SwitchWeights", engine_pb2.SwitchWeightsRequest(
            commit=commit, weight_version=weight_version))

    async def init_weights_update_group(self, group: dict) -> ControlState:
        """group: the request's fields (engine.proto InitWeightsUpdateGroupRequest), already validated."""
        return await self._control("InitWeightsUpdateGroup", engine_pb2.InitWeightsUpdateGroupRequest(**group))

    async def update_weights_from_distributed(self, buckets: list[dict], weight_version: str = "",
                                              group_name: str = "", stage_only: bool = False) -> ControlState:
        request = engine_pb2.UpdateWeightsFromDistributedRequest(weight_version=weight_version, group_name=group_name,
                                                                 stage_only=stage_only)
        for bucket in buckets:
            pb = request.buckets.add(sha256=bucket["sha256"])
            for t in bucket["tensors"]:
                pb.tensors.add(name=t["name"], dtype=t["dtype"], shape=t["shape"])
        return await self._control("UpdateWeightsFromDistributed", request)

    async def sleep(self, level: int) -> ControlState:
        return await self._control("Sleep", engine_pb2.SleepRequest(level=level))

    async def wake_up(self) -> ControlState:
        return await self._control("WakeUp", engine_pb2.WakeUpRequest())

    async def health(self) -> bool:
        """True when the engine's grpc.health.v1 service reports SERVING for the server as a whole ("")."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            logger.debug("engine health check failed: %s", err.code())
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._session is not None:
            self._session.cancel()
        await self._channel.close()
