"""Gateway + scheduler + worker in this process and event loop: the gateway app with a real EngineClient, the
SchedulerService over gRPC, and the worker's plan-stream loop with a fake runner (no model)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from steploop.common.step_contract import WorkerInfo
from steploop.gateway.app import create_app
from steploop.gateway.config import GatewayConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.server import bound_port, start_site
from steploop.gpu_worker import server as worker_server
from steploop.gpu_worker.config import WorkerConfig
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.server import SchedulerService
from steploop.scheduler.server_config import ServerConfig
from tests.scheduler.sched_factories import EOS, FakeWorker

MODEL = "test-model"


class FakeRunner:
    """What gpu_worker.server needs of a ModelRunner: info, tp_comm (None: not a tensor-parallel rank),
    execute(plan), reset()."""

    tp_comm = None

    def __init__(self) -> None:
        self.info = WorkerInfo(worker_id="fake-0", model_name="fake-model", block_size=4, num_kv_blocks=256,
                               max_model_len=2048, vocab_size=49152, eos_token_ids=(EOS,))
        self.reset()

    def execute(self, plan):
        return self.worker.execute(plan)

    def reset(self) -> None:
        self.worker = FakeWorker(block_size=4)


@dataclass
class InProcessCluster:
    base_url: str
    scheduler: SchedulerService


@contextlib.asynccontextmanager
async def inprocess_cluster(tokenizer, engine_session: bool = True) -> AsyncIterator[InProcessCluster]:
    """Serves MODEL until the block exits; then everything is stopped (the worker and scheduler too).
    engine_session=False: the gateway makes one Generate call per request."""
    svc = await SchedulerService(SchedulerConfig(), ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1.0,
                                                                 log_stats_interval=0)).start()
    address = f"127.0.0.1:{svc.port}"
    stop = asyncio.Event()
    worker = asyncio.create_task(worker_server.serve(WorkerConfig(scheduler_address=address, block_size=4),
                                                     runner=FakeRunner(), stop=stop))
    engine = EngineClient(address, multiplex=engine_session)
    app = create_app(GatewayConfig(port=0, served_model_name=MODEL), engine, tokenizer)
    runner, _ = await start_site(app, "127.0.0.1", 0, 1.0)
    try:
        while svc.loop.group is None:
            if worker.done():           # a worker that failed to attach says why instead of hanging the test
                await worker
                raise RuntimeError("the in-process worker stopped before it attached")
            await asyncio.sleep(0.01)
        yield InProcessCluster(f"http://127.0.0.1:{bound_port(runner)}", svc)
    finally:
        await runner.cleanup()
        await engine.close()
        stop.set()
        await worker
        await svc.stop()
