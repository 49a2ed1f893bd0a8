"""The scheduler service over real gRPC: Engine.Generate, aborts by cancellation, worker loss, health."""

from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest
from grpc_health.v1 import health_pb2

from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.common.sampling_params import SamplingParams
from tests.scheduler.sched_factories import fake_model
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker

pytestmark = pytest.mark.asyncio


def expected(prompt: list[int], n: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        t = fake_model(tokens)
        tokens.append(t)
        out.append(t)
    return out


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True).to_pb())


async def until(check, what: str, timeout: float = 10.0) -> None:
    """Polls `check()` (a bool, or an awaitable of one) until it is true; fails naming `what` after `timeout` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert asyncio.get_running_loop().time() < deadline, f"not in {timeout} s: {what}"
        await asyncio.sleep(0.01)      # a poll interval


async def collect(stub, req) -> tuple[list[int], engine_pb2.GenerateChunk]:
    tokens, last = [], None
    async for chunk in stub.Generate(req):
        tokens.extend(chunk.token_ids)
        last = chunk
    return tokens, last


async def test_generate_streams_tokens_and_usage(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    prompts = [[11 + i] * (5 + 7 * i) for i in range(6)]      # 5..40 tokens: several chunks at budget 16
    results = await asyncio.gather(*(collect(stub, request(f"r{i}", p)) for i, p in enumerate(prompts)))
    for prompt, (tokens, last) in zip(prompts, results):
        assert tokens == expected(prompt, 8)
        assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 8)
    await until(lambda: service.loop.scheduler.kv.num_free_blocks == 255,    # all back (block 0 is the null block)
                "every KV block free after the streams ended")
    await worker.kill()


async def test_cancelled_call_aborts_and_frees_blocks(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.01).start()
    call = stub.Generate(request("slow", [12] * 30, max_tokens=400))
    async for _ in call:
        break                                                   # first chunk, then the caller goes away
    call.cancel()
    await until(lambda: not service.loop.scheduler.has_unfinished_requests(), "the cancelled request aborted")
    assert not service.loop.streams and not service.loop.scheduler.has_unfinished_requests()
    assert service.loop.scheduler.kv.num_free_blocks == 255
    await worker.kill()


async def test_worker_loss_is_preemption_and_tokens_are_unchanged(service, engine):
    stub, _ = engine
    first = FakeGrpcWorker(service.address, step_delay=0.01).start()
    task = asyncio.create_task(collect(stub, request("survivor", [13] * 20, max_tokens=60)))
    await until(lambda: first.steps >= 10, "ten steps on the first worker")
    await first.kill()                                          # the stream breaks mid-generation

    async def worker_gone() -> bool:
        return (await stub.GetModelInfo(engine_pb2.ModelInfoRequest())).num_workers == 0
    await until(worker_gone, "the scheduler noticed the lost worker")
    second = FakeGrpcWorker(service.address, worker_id="fake-1").start()
    tokens, last = await asyncio.wait_for(task, 20)
    assert tokens == expected([13] * 20, 60)
    assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    await second.kill()


async def test_no_worker_fails_with_unavailable(service, engine):
    stub, _ = engine
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("orphan", [14] * 4))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker" in info.value.details()


async def test_invalid_requests_are_invalid_argument(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, max_model_len=64).start()
    for req, code in [(request("empty", []), "invalid_request"),
                      (request("long", [15] * 60, max_tokens=10), "context_length_exceeded"),
                      (request("vocab", [5000]), "invalid_request")]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req.request_id
        assert ("steploop-error-code", code) in tuple(info.value.trailing_metadata()), req.request_id
    tokens, _ = await collect(stub, request("fine", [15] * 4, max_tokens=3))
    assert tokens == expected([15] * 4, 3)
    await worker.kill()


async def test_health_follows_the_worker_and_hangs(service, engine):
    stub, health = engine

    async def health_is(want) -> None:
        async def check() -> bool:
            return (await health.Check(health_pb2.HealthCheckRequest(service=""))).status == want
        await until(check, f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(want)}")

    await health_is(health_pb2.HealthCheckResponse.NOT_SERVING)               # no worker yet
    worker = FakeGrpcWorker(service.address).start()
    await health_is(health_pb2.HealthCheckResponse.SERVING)
    worker.paused.clear()                                                     # hung, not dead
    task = asyncio.create_task(collect(stub, request("stuck", [16] * 4)))
    await health_is(health_pb2.HealthCheckResponse.NOT_SERVING)               # past hang_timeout (1 s)
    assert not task.done()
    worker.paused.set()
    await asyncio.wait_for(task, 5)
    await health_is(health_pb2.HealthCheckResponse.SERVING)
    info = await stub.GetModelInfo(engine_pb2.ModelInfoRequest())
    assert (info.model_name, info.num_workers, info.num_kv_blocks) == ("fake-model", 1, 256)
    await worker.kill()


async def test_failed_step_fails_its_requests_and_the_next_ones_run(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    worker.worker.fail_steps = {2}
    tokens, last = await collect(stub, request("unlucky", [17] * 6, max_tokens=10))
    assert last.finish_reason == engine_pb2.FINISH_REASON_ERROR
    assert "illegal memory access" in last.error_message
    tokens, last = await collect(stub, request("next", [17] * 6, max_tokens=4))
    assert tokens == expected([17] * 6, 4) and last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    await until(lambda: service.loop.scheduler.kv.num_free_blocks == 255, "every KV block free")
    service.loop.check_idle()
    await worker.kill()


async def test_idle_check_catches_a_leaked_block(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    await collect(stub, request("ok", [18] * 6, max_tokens=2))
    service.loop.check_idle()
    service.loop.scheduler.kv.pool.get_new_blocks(1)        # a block nobody owns: a leak
    with pytest.raises(AssertionError, match="leak|ref_cnt"):
        service.loop.check_idle()
    await worker.kill()
