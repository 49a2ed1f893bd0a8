"""--max-waiting: a full waiting queue refuses new requests with RESOURCE_EXHAUSTED (+ retry-after metadata)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from steploop.common import grpc_options
from steploop.common.errors import RETRY_AFTER_KEY
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.server import SchedulerService
from steploop.scheduler.server_config import ServerConfig


async def test_full_waiting_queue_is_resource_exhausted():
    svc = SchedulerService(SchedulerConfig(), ServerConfig(host="127.0.0.1", port=0, worker_timeout=30,
                                                           max_waiting=2))
    await svc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}", options=grpc_options.CLIENT) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            assert (await stub.GetModelInfo(engine_pb2.ModelInfoRequest())).max_waiting == 2   # the gateway's 400
            params = SamplingParams(max_tokens=4).to_pb()
            # No worker attached: the first two wait; the third finds the queue full.
            calls = [stub.Generate(engine_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2],
                                                              sampling=params)) for i in range(2)]
            readers = [asyncio.ensure_future(c.read()) for c in calls]
            while svc.loop.load_report().num_waiting < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(engine_pb2.GenerateRequest(request_id="r3", prompt_token_ids=[1],
                                                                        sampling=params)):
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-waiting 2" in err.value.details()
            assert (RETRY_AFTER_KEY, "1") in tuple(err.value.trailing_metadata())
            for c in calls:
                c.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
    finally:
        await svc.stop()


def test_max_waiting_must_be_positive():
    with pytest.raises(ValueError, match="--max-waiting"):
        ServerConfig(max_waiting=0).validate()
