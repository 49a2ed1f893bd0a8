"""Engine control over real gRPC with a fake worker: the three pause modes, requests held while paused, resume,
and weight updates (every rank loads, then all switch, or none), with tokens unchanged by any of it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from steploop.common.pb.steploop.v1 import engine_pb2
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker
from tests.scheduler_service.test_engine_service import collect, expected, request, until

PROMPT = [21, 22, 23, 24, 25, 26]


def _pause(mode: str) -> engine_pb2.PauseRequest:
    return engine_pb2.PauseRequest(mode=engine_pb2.PauseMode.Value(f"PAUSE_MODE_{mode.upper()}"))


async def _started(stub, rid: str, max_tokens: int):
    """A request streaming in the background, and its first chunk's arrival."""
    got: list[int] = []
    first = asyncio.Event()

    async def run():
        last = None
        async for chunk in stub.Generate(request(rid, PROMPT, max_tokens)):
            got.extend(chunk.token_ids)
            first.set()
            last = chunk
        return last

    task = asyncio.ensure_future(run())
    await asyncio.wait_for(first.wait(), 10)
    return task, got


async def _idle_and_whole(service) -> None:
    await until(lambda: not service.loop.has_work(), "the engine is idle")
    kv = service.loop.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    service.loop.scheduler.check_integrity()


async def test_pause_abort_ends_live_requests_and_holds_new_ones(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.02).start()
    try:
        task, _ = await _started(stub, "long", 200)
        state = await stub.Pause(_pause("abort"))
        assert state.paused and state.num_aborted == 1
        last = await asyncio.wait_for(task, 5)
        assert last.finish_reason == engine_pb2.FINISH_REASON_ABORT
        held = asyncio.ensure_future(collect(stub, request("held", PROMPT, 5)))
        await asyncio.sleep(0.3)
        assert not held.done() and (await stub.GetLoadReport(engine_pb2.LoadReportRequest())).num_waiting == 1
        assert (await stub.GetEngineControlState(engine_pb2.EngineControlStateRequest())).paused
        state = await stub.Resume(engine_pb2.ResumeRequest())
        assert not state.paused
        tokens, _ = await asyncio.wait_for(held, 10)
        assert tokens == expected(PROMPT, 5)
        await _idle_and_whole(service)
    finally:
        await worker.kill()


async def test_pause_wait_lets_live_requests_finish_first(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.01).start()
    try:
        task, _ = await _started(stub, "live", 30)
        state = await asyncio.wait_for(stub.Pause(_pause("wait")), 20)
        assert state.paused and state.num_aborted == 0
        assert "live" not in service.loop.streams     # it ran to its end before the pause returned
        last = await asyncio.wait_for(task, 5)
        assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 30
        steps = worker.steps
        held = asyncio.ensure_future(collect(stub, request("held", PROMPT, 4)))
        await asyncio.sleep(0.3)
        assert not held.done() and worker.steps == steps
        await stub.Resume(engine_pb2.ResumeRequest())
        assert (await asyncio.wait_for(held, 10))[0] == expected(PROMPT, 4)
    finally:
        await worker.kill()


async def test_pause_keep_preempts_and_resume_continues_with_the_same_tokens(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.02).start()
    try:
        task, got = await _started(stub, "kept", 40)
        state = await stub.Pause(_pause("keep"))
        assert state.paused and state.num_preempted == 1
        assert any(p.preempted_handles for p in worker.plans)      # the worker was told to drop it
        assert service.loop.scheduler.kv.prefix_cache_stats.resets >= 1
        steps, delivered = worker.steps, len(got)
        await asyncio.sleep(0.3)
        assert worker.steps == steps and len(got) == delivered and not task.done()
        assert (await stub.GetLoadReport(engine_pb2.LoadReportRequest())).num_running == 0
        await stub.Resume(engine_pb2.ResumeRequest())
        last = await asyncio.wait_for(task, 20)
        assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert got == expected(PROMPT, 40)                          # recomputed, not repeated or lost
        await _idle_and_whole(service)
    finally:
        await worker.kill()


async def test_weight_update_loads_then_switches_and_reports_the_version(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.01).start()
    try:
        await until(lambda: worker.alive() and service.loop.group is not None, "the worker attached")
        task, got = await _started(stub, "spans", 40)
        state = await stub.UpdateWeightsFromDisk(engine_pb2.UpdateWeightsFromDiskRequest(model_path="/ckpt/a"))
        assert (state.weight_version, state.weight_updates, state.num_preempted) == ("1", 1, 1)
        kinds = [c.WhichOneof("op") for c in worker.controls]
        assert kinds == ["weights_load", "weights_swap"] and worker.controls[1].weights_swap.commit
        assert worker.controls[0].weights_load.model_path == "/ckpt/a"
        await asyncio.wait_for(task, 20)
        assert got == expected(PROMPT, 40)
        state = await stub.UpdateWeightsFromDisk(engine_pb2.UpdateWeightsFromDiskRequest(
            model_path="/ckpt/b", weight_version="step-2"))
        assert state.weight_version == "step-2"
        metrics = (await stub.GetMetrics(engine_pb2.MetricsRequest())).text
        assert 'steploop:weight_updates_total{model_name="fake-model"} 2.0' in metrics
        assert 'steploop:weight_version_info{model_name="fake-model",version="step-2"} 1.0' in metrics
    finally:
        await worker.kill()


async def test_refused_weights_are_dropped_by_every_rank_and_the_old_ones_serve(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    try:
        await until(lambda: worker.alive() and service.loop.group is not None, "the worker attached")
        worker.load_error = "model.norm.weight: checkpoint shape (8,) != (16,)"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeightsFromDisk(engine_pb2.UpdateWeightsFromDiskRequest(model_path="/ckpt/bad"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checkpoint shape" in info.value.details() and "old weights keep serving" in info.value.details()
        assert [c.WhichOneof("op") for c in worker.controls] == ["weights_load", "weights_swap"]
        assert not worker.controls[1].weights_swap.commit
        state = await stub.GetEngineControlState(engine_pb2.EngineControlStateRequest())
        assert (state.weight_version, state.weight_updates) == ("0", 0)
        assert (await collect(stub, request("after", PROMPT, 4)))[0] == expected(PROMPT, 4)
    finally:
        await worker.kill()


async def test_staged_weights_wait_for_switch_weights_to_commit_or_drop_them(service, engine):
    """The two halves a router drives across replicas: stage (old weights serve on), then commit or drop."""
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.01).start()
    try:
        await until(lambda: worker.alive() and service.loop.group is not None, "the worker attached")
        with pytest.raises(grpc.aio.AioRpcError) as info:          # nothing staged yet
            await stub.SwitchWeights(engine_pb2.SwitchWeightsRequest(commit=True))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no weights are staged" in info.value.details()
        task, got = await _started(stub, "spans", 40)
        state = await stub.UpdateWeightsFromDisk(engine_pb2.UpdateWeightsFromDiskRequest(model_path="/ckpt/a",
                                                                                         stage_only=True))
        assert (state.weight_version, state.weights_staged, state.num_preempted) == ("0", True, 0)
        assert [c.WhichOneof("op") for c in worker.controls] == ["weights_load"]
        state = await stub.SwitchWeights(engine_pb2.SwitchWeightsRequest(commit=True, weight_version="rl-1"))
        assert (state.weight_version, state.weight_updates, state.weights_staged) == ("rl-1", 1, False)
        assert worker.controls[-1].weights_swap.commit
        await asyncio.wait_for(task, 20)
        assert got == expected(PROMPT, 40)                          # preempted at the switch, recomputed
        await stub.UpdateWeightsFromDisk(engine_pb2.UpdateWeightsFromDiskRequest(model_path="/ckpt/b",
                                                                                 stage_only=True))
        state = await stub.SwitchWeights(engine_pb2.SwitchWeightsRequest(commit=False))
        assert (state.weight_version, state.weights_staged) == ("rl-1", False)
        assert not worker.controls[-1].weights_swap.commit
        await _idle_and_whole(service)
    finally:
        await worker.kill()


async def test_a_worker_that_attaches_after_updates_serves_the_updated_weights(service, engine):
    """A restarted worker starts from its launch weights: it loads the last update's folder before its first step;
    after an update over the collective (no folder), the version honestly goes back to "0"."""
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    try:
        await until(lambda: worker.alive() and service.loop.group is not None, "the worker attached")
        await stub.UpdateWeightsFromDisk(engine_pb2.UpdateWeightsFromDiskRequest(model_path="/ckpt/a"))
    finally:
        await worker.kill()
    await until(lambda: service.loop.group is None, "the worker was lost")
    worker = FakeGrpcWorker(service.address).start()
    try:
        assert (await collect(stub, request("after", PROMPT, 4)))[0] == expected(PROMPT, 4)
        assert [c.WhichOneof("op") for c in worker.controls] == ["weights_load", "weights_swap"]
        assert worker.controls[0].weights_load.model_path == "/ckpt/a" and worker.controls[1].weights_swap.commit
        state = await stub.GetEngineControlState(engine_pb2.EngineControlStateRequest())
        assert (state.weight_version, state.weight_updates) == ("1", 1)
        bucket = engine_pb2.WeightBucket(sha256="ab" * 32)
        state = await stub.UpdateWeightsFromDistributed(engine_pb2.UpdateWeightsFromDistributedRequest(
            buckets=[bucket], weight_version="rl-2"))
        assert state.weight_version == "rl-2"
    finally:
        await worker.kill()
    await until(lambda: service.loop.group is None, "the worker was lost")
    worker = FakeGrpcWorker(service.address).start()
    try:
        assert (await collect(stub, request("again", PROMPT, 4)))[0] == expected(PROMPT, 4)
        assert worker.controls == []                  # nothing to load: the collective's weights are gone
        state = await stub.GetEngineControlState(engine_pb2.EngineControlStateRequest())
        assert (state.weight_version, state.weight_updates) == ("0", 2)
    finally:
        await worker.kill()


async def test_weight_update_with_no_worker_is_unavailable(service, engine):
    stub, _ = engine
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UpdateWeightsFromDisk(engine_pb2.UpdateWeightsFromDiskRequest(model_path="/ckpt/a"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture
async def events_service():
    from steploop.scheduler.config import SchedulerConfig
    from steploop.scheduler.kv_events.config import KvEventsConfig
    from steploop.scheduler.server import SchedulerService
    from steploop.scheduler.server_config import ServerConfig
    svc = SchedulerService(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8,
                                           kv_events=KvEventsConfig(enable_kv_cache_events=True, publisher="null")),
                           ServerConfig(host="127.0.0.1", port=0, worker_timeout=1.5, hang_timeout=1.0,
                                        shutdown_timeout=2.0))
    await svc.start()
    svc.address = f"127.0.0.1:{svc.port}"
    yield svc
    await svc.stop()


async def test_pause_keep_publishes_all_blocks_cleared(events_service):
    async with grpc.aio.insecure_channel(events_service.address) as channel:
        from steploop.common.pb.steploop.v1 import engine_pb2_grpc
        stub = engine_pb2_grpc.EngineStub(channel)
        worker = FakeGrpcWorker(events_service.address, step_delay=0.01).start()
        try:
            await collect(stub, request("warm", PROMPT * 3, 4))     # full blocks enter the prefix cache
            seen: list[str] = []

            async def watch():
                async for msg in stub.WatchKVEvents(engine_pb2.KvEventWatchRequest()):
                    if msg.HasField("batch"):
                        seen.extend(e.WhichOneof("event") for e in msg.batch.events)

            watcher = asyncio.ensure_future(watch())
            await asyncio.sleep(0.2)
            await stub.Pause(_pause("keep"))
            await until(lambda: "cleared" in seen, "AllBlocksCleared was published")
            watcher.cancel()
            assert not events_service.loop.scheduler.kv.pool.block_hash
            await stub.Resume(engine_pb2.ResumeRequest())
        finally:
            await worker.kill()


async def test_sleep_preempts_holds_and_wake_up_resumes(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.02).start()
    try:
        task, got = await _started(stub, "sleeper", 30)
        state = await stub.Sleep(engine_pb2.SleepRequest(level=1))
        assert (state.paused, state.sleep_level, state.num_preempted) == (True, 1, 1)
        assert [c.WhichOneof("op") for c in worker.controls] == ["sleep"] and worker.controls[0].sleep.level == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:      # resuming would step on a worker with no KV cache
            await stub.Resume(engine_pb2.ResumeRequest())
        assert "asleep" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Sleep(engine_pb2.SleepRequest(level=2))
        steps = worker.steps
        await asyncio.sleep(0.2)
        assert worker.steps == steps and not task.done()
        state = await stub.WakeUp(engine_pb2.WakeUpRequest())
        assert (state.paused, state.sleep_level) == (False, 0)
        assert [c.WhichOneof("op") for c in worker.controls] == ["sleep", "wake_up"]
        await asyncio.wait_for(task, 20)
        assert got == expected(PROMPT, 30)
    finally:
        await worker.kill()


async def test_resume_during_pause_wait_and_wait_after_keep(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.02).start()
    try:
        task, got = await _started(stub, "slow", 60)
        waiting = asyncio.ensure_future(stub.Pause(_pause("wait")))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await stub.Resume(engine_pb2.ResumeRequest())
        state = await asyncio.wait_for(waiting, 5)            # returned, and nothing is left frozen
        assert not state.paused and not service.loop.control.frozen
        await stub.Pause(_pause("keep"))
        state = await asyncio.wait_for(stub.Pause(_pause("wait")), 5)   # kept requests do not block it
        assert state.paused
        await stub.Resume(engine_pb2.ResumeRequest())
        await asyncio.wait_for(task, 20)
        assert got == expected(PROMPT, 60)
    finally:
        await worker.kill()
