"""A migrated request over real gRPC (GenerateRequest.resume_output_token_ids): the engine streams only the
tokens after the delivered ones, usage counts the delivered ones as completion tokens and the prompt as it was,
and the scheduler's metrics and stats line count it as migrated in. Resumed ids are checked like prompt ids."""

from __future__ import annotations

import grpc
import pytest

from steploop.common.pb.steploop.v1 import engine_pb2
from tests.scheduler_service.fake_grpc_worker import FakeGrpcWorker
from tests.scheduler_service.test_engine_service import collect, expected, request

PROMPT = [11, 12, 13, 14, 15]


async def test_resumed_after_delivered_tokens(service, engine):
    stub, _ = engine
    worker = FakeGrpcWorker(service.address).start()
    try:
        full = expected(PROMPT, 8)
        resumed = request("moved", PROMPT, max_tokens=8)
        resumed.resume_output_token_ids.extend(full[:3])
        tokens, last = await collect(stub, resumed)
        assert tokens == full[3:]
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 8)
        assert service.loop.observer.resumed_requests == 1
        text = (await stub.GetMetrics(engine_pb2.MetricsRequest())).text
        assert 'steploop:resumed_requests_total{model_name="fake-model"} 1.0' in text
        bad = request("bad", PROMPT)
        bad.resume_output_token_ids.append(5000)            # the fake model's vocab is 1000
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume_output_token_ids" in str(
            info.value.trailing_metadata())
    finally:
        await worker.kill()
