"""Engine.Session over real gRPC: many requests on one stream, one message per step, per-request errors, aborts
by message and by closing the stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from steploop.common.pb.steploop.v1 import engine_pb2
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker
from tests.scheduler_service.test_engine_service import expected, request

pytestmark = pytest.mark.asyncio


def generate(req: engine_pb2.GenerateRequest) -> engine_pb2.SessionRequest:
    return engine_pb2.SessionRequest(generate=req)


async def open_session(stub, *requests: engine_pb2.GenerateRequest):
    """A Session call with these requests sent, in order."""
    call = stub.Session()
    for req in requests:
        await call.write(generate(req))
    return call


def abort(*ids: str) -> engine_pb2.SessionRequest:
    return engine_pb2.SessionRequest(abort=engine_pb2.AbortRequest(request_ids=ids))


async def drain(call, until_done: set[str]) -> tuple[dict, dict, int]:
    """Reads until every id in until_done has its last chunk or an error: (tokens by id, last entry by id,
    messages read)."""
    tokens: dict[str, list[int]] = {}
    last: dict[str, engine_pb2.SessionChunk] = {}
    messages = 0
    while until_done - last.keys():
        message = await asyncio.wait_for(call.read(), 20)
        assert message is not grpc.aio.EOF
        messages += 1
        assert len({e.request_id for e in message.chunks}) == len(message.chunks)   # one entry per request
        for entry in message.chunks:
            tokens.setdefault(entry.request_id, []).extend(entry.chunk.token_ids)
            if entry.HasField("error") or entry.chunk.finish_reason:
                last[entry.request_id] = entry
    return tokens, last, messages


async def wait_idle(service) -> None:
    for _ in range(200):
        if not service.loop.streams and not service.loop.scheduler.has_unfinished_requests():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still live: {list(service.loop.streams)}")


async def test_one_stream_carries_many_requests_one_message_per_step(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    prompts = [[21 + i] * (3 + 5 * i) for i in range(6)]
    call = await open_session(stub, *(request(f"s{i}", prompt, max_tokens=12) for i, prompt in enumerate(prompts)))
    tokens, last, messages = await drain(call, {f"s{i}" for i in range(6)})
    for i, prompt in enumerate(prompts):
        assert tokens[f"s{i}"] == expected(prompt, 12)
        chunk = last[f"s{i}"].chunk
        assert chunk.finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (len(prompt), 12)
    assert messages < sum(len(t) for t in tokens.values()) / 3   # steps, not tokens
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF   # the caller is done, so is the stream
    await wait_idle(service)
    assert service.loop.scheduler.kv.num_free_blocks == 255
    await worker.kill()


async def test_a_bad_request_fails_alone_and_the_stream_goes_on(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, max_model_len=64).start()
    call = await open_session(stub, request("ok", [31] * 4, max_tokens=5), request("long", [31] * 60, max_tokens=10),
                              request("", [31] * 4), request("twice", [32] * 4, max_tokens=50),
                              request("twice", [32] * 4))     # a live id again: both end, with one error
    tokens, last, _ = await drain(call, {"ok", "long", "", "twice"})
    assert tokens["ok"] == expected([31] * 4, 5)
    assert last["twice"].error.code == "duplicate_request_id"
    error = last["long"].error
    assert (error.status_code, error.code, error.param) == (grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                            "context_length_exceeded", "max_tokens")
    assert "context length" in error.message
    assert last[""].error.param == "request_id"
    call.cancel()
    await wait_idle(service)
    await worker.kill()


async def test_abort_message_drops_the_request_and_no_chunk_follows(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.01).start()
    call = await open_session(stub, request("slow", [41] * 30, max_tokens=400), request("short", [42] * 5, max_tokens=30))
    first = await asyncio.wait_for(call.read(), 20)
    assert first.chunks
    await call.write(abort("slow", "unknown-id"))
    tokens, last, _ = await drain(call, {"short"})
    assert tokens["short"] == expected([42] * 5, 30)
    assert "slow" not in last                      # no last chunk for a request its caller gave up on
    await wait_idle(service)
    assert service.loop.scheduler.kv.num_free_blocks == 255
    call.cancel()
    await worker.kill()


async def test_closing_the_stream_aborts_every_live_request(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address, step_delay=0.01).start()
    call = await open_session(stub, *(request(f"c{i}", [51 + i] * 20, max_tokens=400) for i in range(4)))
    await asyncio.wait_for(call.read(), 20)
    assert len(service.loop.streams) == 4
    call.cancel()                                   # the gateway went away
    await wait_idle(service)
    assert service.loop.scheduler.kv.num_free_blocks == 255
    await worker.kill()


async def test_no_worker_fails_each_request_with_unavailable(service, engine):
    stub, _ = engine
    call = await open_session(stub, request("orphan", [14] * 4))
    _, last, _ = await drain(call, {"orphan"})
    assert last["orphan"].error.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "worker" in last["orphan"].error.message
    call.cancel()


async def test_once_shutdown_began_new_requests_are_unavailable_on_both_rpcs(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    service.loop.accepting = False                  # what SchedulerService.stop does first
    call = await open_session(stub, request("late", [15] * 4))
    _, last, _ = await drain(call, {"late"})
    assert last["late"].error.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "shutting down" in last["late"].error.message
    call.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(request("late-call", [15] * 4)):
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    service.loop.accepting = True
    await worker.kill()
