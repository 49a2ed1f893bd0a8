"""The scheduler service: a grpc.aio server with Engine, PlanStream and grpc.health.v1, and the step loop.

Shutdown is a sequence: health NOT_SERVING, stop accepting new requests, let in-flight streams finish within
--shutdown-timeout, then stop the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import grpc_options
from services.common.log import setup_logging
from services.common.pb.steploop.v1 import engine_pb2_grpc, worker_pb2_grpc
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.server_config import ServerConfig
from services.scheduler.servicers import EngineServicer, PlanStreamServicer

log = logging.getLogger("steploop.scheduler")
ENGINE_SERVICE = "steploop.v1.Engine"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_cli_args(parser)
    SchedulerConfig.add_cli_args(parser)


async def _watch_health(loop: EngineLoop, servicer: health.aio.HealthServicer, stop: asyncio.Event) -> None:
    last = None
    while not stop.is_set():
        serving = loop.is_serving()
        if serving != last:
            status = health_pb2.HealthCheckResponse.SERVING if serving else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", ENGINE_SERVICE):
                await servicer.set(name, status)
            if last is not None:
                log.info("health: %s", "SERVING" if serving else "NOT_SERVING")
            last = serving
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def serve(sched_config: SchedulerConfig, server_config: ServerConfig) -> None:
    loop = EngineLoop(sched_config, server_config)
    server = grpc.aio.server(options=grpc_options.SERVER)
    engine = EngineServicer(loop)
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    worker_pb2_grpc.add_PlanStreamServicer_to_server(PlanStreamServicer(loop), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(server_config.address)
    await server.start()
    log.info("scheduler listening on %s (budget %d tokens/step, max %d seqs)", server_config.address,
             sched_config.max_num_batched_tokens, sched_config.max_num_seqs)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(loop.run(), name="step-loop"),
             asyncio.create_task(_watch_health(loop, health_servicer, stop), name="health")]
    done, _ = await asyncio.wait([*tasks, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task in tasks and task.exception():
            log.error("%s crashed", task.get_name(), exc_info=task.exception())
    await _shutdown(server, engine, loop, health_servicer, server_config.shutdown_timeout)
    for task in tasks:
        task.cancel()


async def _shutdown(server, engine: EngineServicer, loop: EngineLoop, health_servicer, grace: float) -> None:
    log.info("shutting down: NOT_SERVING, draining %d live requests (up to %.0f s)", len(loop.streams), grace)
    await health_servicer.enter_graceful_shutdown()
    engine.accepting = False
    deadline = asyncio.get_running_loop().time() + grace
    while loop.streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    await server.stop(grace=1.0)
    log.info("scheduler stopped")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="steploop scheduler", description=__doc__)
    add_cli_args(parser)
    args = parser.parse_args(argv)
    setup_logging("scheduler")
    sched_config, server_config = SchedulerConfig.from_args(args), ServerConfig.from_args(args)
    try:
        import uvloop
        uvloop.run(serve(sched_config, server_config))
    except ImportError:
        asyncio.run(serve(sched_config, server_config))
