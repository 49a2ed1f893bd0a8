"""Fixtures for the scheduler service over real gRPC: a SchedulerService on a free port and Engine stubs to it."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from steploop.common import grpc_options
from steploop.common.pb.steploop.v1 import engine_pb2_grpc
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.server import SchedulerService
from steploop.scheduler.server_config import ServerConfig


@pytest.fixture
async def service():
    svc = SchedulerService(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                           ServerConfig(host="127.0.0.1", port=0, worker_timeout=1.5, hang_timeout=1.0,
                                        shutdown_timeout=2.0))
    await svc.start()
    svc.address = f"127.0.0.1:{svc.port}"
    yield svc
    await svc.stop()


@pytest.fixture
async def engine(service):
    async with grpc.aio.insecure_channel(service.address, options=grpc_options.CLIENT) as channel:
        yield engine_pb2_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel)
