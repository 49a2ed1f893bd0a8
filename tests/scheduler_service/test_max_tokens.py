"""max_tokens means one thing on the Engine API: unset is what fits in the context; set, it must fit with the
prompt. The engine resolves and checks it once (request_outputs.resolve_max_tokens), with one message that names
the prompt, the completion and the context, over real gRPC through the project's own client."""

from __future__ import annotations

import pytest

from steploop.client import APIError, EngineClient, EngineRequest, FinishReason, SamplingParams
from steploop.common.pb.steploop.v1 import engine_pb2
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker


async def run(client: EngineClient, rid: str, prompt: list[int], params: SamplingParams) -> list:
    return [chunk async for chunk in client.generate(EngineRequest(rid, list(prompt), params))]


async def test_unset_is_what_fits_and_set_must_fit(service):
    worker = FakeGrpcWorker(service.address, max_model_len=64).start()
    client = EngineClient(service.address)
    try:
        chunks = await run(client, "fits", [15] * 50, SamplingParams(ignore_eos=True))   # unset
        assert sum(len(c.token_ids) for c in chunks) == 14 and chunks[-1].finish_reason == FinishReason.LENGTH
        assert chunks[-1].usage.completion_tokens == 14
        for prompt, max_tokens, param, numbers in [([15] * 50, 20, "max_tokens", ("64", "70", "50", "20")),
                                                   ([15] * 64, None, "prompt", ("64", "65", "64"))]:
            with pytest.raises(APIError) as info:
                await run(client, "long", prompt, SamplingParams(max_tokens=max_tokens))
            err = info.value
            assert (err.status, err.code, err.param) == (400, "context_length_exceeded", param)
            assert all(n in err.message for n in numbers), err.message
        with pytest.raises(APIError) as info:
            await run(client, "short", [15] * 50, SamplingParams(min_tokens=20))   # what fits is 14
        assert (info.value.status, info.value.param) == (400, "min_tokens") and "14" in info.value.message
        with pytest.raises(APIError) as info:
            await run(client, "zero", [15] * 4, SamplingParams(max_tokens=0))      # set: at least 1
        assert (info.value.status, info.value.param) == (400, "max_tokens")
    finally:
        await client.close()
        await worker.kill()


def test_the_wire_tells_unset_from_zero():
    assert not SamplingParams().to_pb().HasField("max_tokens")
    assert SamplingParams.from_pb(engine_pb2.SamplingParams()).max_tokens is None
    assert SamplingParams.from_pb(SamplingParams(max_tokens=0).to_pb()).max_tokens == 0
    assert SamplingParams.from_pb(SamplingParams(max_tokens=7).to_pb()).max_tokens == 7
