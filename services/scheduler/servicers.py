"""Thin gRPC servicers: Engine (the public token API: per-request Generate calls, or many requests on one
Session stream) and PlanStream (workers attach). Errors map in one place
(steploop.common.errors); everything else lives in EngineLoop."""

from __future__ import annotations

import logging

import grpc

from steploop.common import metrics, tracing
from steploop.common.engine_contract import KV_EVENTS_RESUMED_METADATA, EngineRequest
from steploop.common.engine_control import PAUSE_MODES
from steploop.common.errors import EngineError, InvalidRequestError, abort_with
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc, worker_pb2_grpc
from steploop.common.step_contract import SCHEDULER_STOPPING_METADATA, WorkerInfo
from steploop.scheduler import tracing as request_tracing
from steploop.scheduler.engine_loop import EngineLoop
from steploop.scheduler.kv_events.hub import WatcherCutOff, message_pb
from steploop.scheduler.session import EngineSession
from steploop.scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, loop: EngineLoop):
        self.loop = loop

    async def Generate(self, request, context):
        try:
            with tracing.grpc_server_context(context):   # the caller's trace, if tracing is on
                stream = self.loop.add_request(EngineRequest.from_pb(request))
        except EngineError as err:
            await abort_with(context, err)
        try:
            while not stream.finished:
                try:
                    chunk = await stream.next_chunk()
                except EngineError as err:
                    await abort_with(context, err)
                yield chunk.to_pb()
        finally:
            if not stream.finished:          # the caller cancelled: abort, no polling
                self.loop.abort(stream.request_id)

    async def Session(self, request_iterator, context):
        session = EngineSession(self.loop)
        await session.serve(request_iterator, context.write)

    async def Abort(self, request, context):
        live = [rid for rid in request.request_ids if rid in self.loop.streams]
        for rid in live:
            self.loop.abort(rid, "abort_rpc")
        return engine_pb2.AbortResponse(num_aborted=len(live))

    async def GetModelInfo(self, request, context):
        info, group = self.loop.worker_info, self.loop.group
        if info is None:
            return engine_pb2.ModelInfo(
                num_workers=0, max_waiting=self.loop.server_config.max_waiting,
                lora_adapters=[engine_pb2.LoraAdapterRef(name=m.name, path=m.path) for m in self.loop.lora.modules])
        return engine_pb2.ModelInfo(
            model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            block_size=info.block_size, num_kv_blocks=info.num_kv_blocks, eos_token_ids=info.eos_token_ids,
            num_workers=0 if group is None else group.world_size,
            max_waiting=self.loop.server_config.max_waiting, runner=info.runner,
            pooling=info.pooling.to_pb() if info.pooling is not None else None,
            generation_defaults=info.generation_defaults.to_pb(),
            lora_adapters=[engine_pb2.LoraAdapterRef(name=m.name, path=m.path) for m in self.loop.lora.modules],
            kv_block_bytes=info.transfer_block_bytes)

    async def ExportKvBlocks(self, request, context):
        """Another replica pulls a prefix cached here (kv_pull_export.py): sent blocks, or 0 and why."""
        if not tracing.ENABLED:
            return (await self._export(request)).to_pb()
        with tracing.grpc_server_context(context), \
                request_tracing.kv_export(request.transfer_id, len(request.block_hashes)) as span:
            answer = await self._export(request)
            request_tracing.kv_export_answer(span, answer.num_blocks, answer.bytes, answer.reason)
        return answer.to_pb()

    async def _export(self, request):
        return await self.loop.kv_export.export(request.transfer_id, list(request.block_hashes),
                                                request.destination, self.loop.server_config.kv_transfer_lease)

    async def GetLoadReport(self, request, context):
        return self.loop.load_report().to_pb()

    async def LoadLoraAdapter(self, request, context):
        try:
            self.loop.lora.load(request.name, request.path)
        except EngineError as err:
            await abort_with(context, err)
        return engine_pb2.LoraAdapterReply()

    async def UnloadLoraAdapter(self, request, context):
        try:
            self.loop.lora.unload(request.name)
        except EngineError as err:
            await abort_with(context, err)
        return engine_pb2.LoraAdapterReply()


    # ---- engine control (the gateway's admin routes; engine_control.py) ----
    async def _control(self, context, call):
        try:
            return (await call).to_pb()
        except EngineError as err:
            await abort_with(context, err)

    async def Pause(self, request, context):
        return await self._control(context, self.loop.control.pause(PAUSE_MODES[request.mode]))

    async def Resume(self, request, context):
        return await self._control(context, self.loop.control.resume())

    async def GetEngineControlState(self, request, context):
        return self.loop.control.state().to_pb()

    async def UpdateWeightsFromDisk(self, request, context):
        if not request.model_path:
            await abort_with(context, InvalidRequestError("model_path is required", param="model_path"))
        return await self._control(context, self.loop.control.update_weights_from_disk(
            request.model_path, request.weight_version, request.stage_only))

    async def InitWeightsUpdateGroup(self, request, context):
        if not request.master_address or not request.master_port or request.world_size < 2:
            await abort_with(context, InvalidRequestError("master_address, master_port and a world_size of at least "
                                                          "2 are required", param="master_address"))
        return await self._control(context, self.loop.control.init_weights_update_group(request))

    async def UpdateWeightsFromDistributed(self, request, context):
        if not request.buckets:
            await abort_with(context, InvalidRequestError("buckets is required", param="buckets"))
        return await self._control(context, self.loop.control.update_weights_from_distributed(
            request.buckets, request.weight_version, request.stage_only))

    async def SwitchWeights(self, request, context):
        return await self._control(context, self.loop.control.switch_weights(request.commit, request.weight_version))

    async def Sleep(self, request, context):
        return await self._control(context, self.loop.control.sleep(request.level))

    async def WakeUp(self, request, context):
        return await self._control(context, self.loop.control.wake_up())

    async def GetMetrics(self, request, context):
        return engine_pb2.MetricsText(text=metrics.exposition(self.loop.observer.registry).decode())

    async def WatchKVEvents(self, request, context):
        hub = self.loop.kv_events
        if hub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are off on this scheduler; start "
                                "it with --kv-events-config '{\"enable_kv_cache_events\": true}'")
        resumed = hub.resumes(request.instance_id, request.from_sequence)
        await context.send_initial_metadata(((KV_EVENTS_RESUMED_METADATA, "1" if resumed else "0"),))
        try:
            async for item in hub.watch(request.from_sequence, request.instance_id):
                yield message_pb(item)
        except WatcherCutOff as err:
            await context.abort(grpc.StatusCode.ABORTED, f"KV event watcher cut off ({err}); reconnect")


class PlanStreamServicer(worker_pb2_grpc.PlanStreamServicer):
    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.links: set[WorkerLink] = set()

    def end_all(self) -> None:
        """The scheduler is stopping: end every plan stream (with SCHEDULER_STOPPING_METADATA), so each worker
        hears an ordered stop rather than a broken stream."""
        for link in list(self.links):
            link.ended_by_stop = True
            link.close("the scheduler is stopping")

    async def Attach(self, request_iterator, context):
        hello = await context.read()
        if hello is grpc.aio.EOF or not hello.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a WorkerHello")
        link = WorkerLink(context, WorkerInfo.from_pb(hello.hello))
        try:
            self.loop.attach(link)
        except EngineError as err:
            await abort_with(context, err)
        self.links.add(link)
        try:
            await link.read_loop()           # until the stream breaks; the step loop writes on it meanwhile
        finally:
            self.links.discard(link)
            self.loop.detach(link, link.close_reason or "stream closed")
        if link.ended_by_stop:               # end_all: the stream ends with OK and says why
            context.set_trailing_metadata((SCHEDULER_STOPPING_METADATA,))
