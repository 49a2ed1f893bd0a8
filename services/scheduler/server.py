"""The scheduler service: a grpc.aio server with Engine, PlanStream and grpc.health.v1, and the step loop.

Server reflection (grpc.reflection.v1alpha) describes Engine and Health, so grpcurl, grpcui and Postman can list
and call them without the protos in hand; PlanStream stays internal (workers ship its stubs).

Shutdown is a sequence: health NOT_SERVING, stop accepting new requests, let in-flight streams finish within
--shutdown-timeout, then stop the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from steploop.common import event_loop, grpc_options, observability, tls
from steploop.common.metrics import MetricsServer
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.scheduler import fastpath, gc_tuning
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.engine_loop import EngineLoop
from steploop.scheduler.server_config import ServerConfig
from steploop.scheduler.servicers import EngineServicer, PlanStreamServicer
from steploop.scheduler.worker_link import add_plan_stream_servicer

log = logging.getLogger("steploop.scheduler")
ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name     # steploop.v1.Engine
REFLECTED_SERVICES = (ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_cli_args(parser)
    SchedulerConfig.add_cli_args(parser)
    observability.add_cli_args(parser)


class SchedulerService:
    """The running service: gRPC server, step loop and health watcher. `serve` and tests drive it."""

    def __init__(self, sched_config: SchedulerConfig, server_config: ServerConfig):
        self.config = server_config
        self.loop = EngineLoop(sched_config, server_config)
        self.server = grpc.aio.server(options=grpc_options.SERVER)
        self.engine = EngineServicer(self.loop)
        self.health = health.aio.HealthServicer()
        engine_pb2_grpc.add_EngineServicer_to_server(self.engine, self.server)
        self.plan_streams = PlanStreamServicer(self.loop)
        add_plan_stream_servicer(self.plan_streams, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(REFLECTED_SERVICES, self.server)
        self.port = tls.add_server_port(self.server, server_config.address, server_config.tls)
        self._stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.metrics_server = MetricsServer(self.loop.observer.registry, "scheduler")

    async def start(self) -> SchedulerService:
        # The plain-decode C loops compile (gcc, ~1 s) on first use: here, before serving, not on the event loop
        # when the first worker attaches and its Scheduler is built.
        await asyncio.get_running_loop().run_in_executor(None, fastpath.load)
        await self.server.start()
        if self.config.metrics_port:
            await self.metrics_server.start(self.config.host, self.config.metrics_port)
        self.tasks = [asyncio.create_task(self.loop.run(), name="step-loop"),
                      asyncio.create_task(self._watch_health(), name="health")]
        if self.config.log_stats_interval > 0:
            self.tasks.append(asyncio.create_task(self._log_stats(self.config.log_stats_interval), name="stats"))
        return self

    async def _log_stats(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), interval)
            except asyncio.TimeoutError:
                try:
                    self.loop.observer.log_stats()
                except Exception:  # a stats line must never take the service down
                    log.exception("engine stats line failed")

    async def wait(self, stop: asyncio.Event) -> bool:
        """Until `stop` is set (returns True) or a task crashes (logged; returns False)."""
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([*self.tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        crashed = [task for task in done if task is not waiter and not task.cancelled() and task.exception()]
        for task in crashed:
            log.critical("%s crashed", task.get_name(), exc_info=task.exception())
        return not crashed

    async def stop(self) -> None:
        """health NOT_SERVING, refuse new requests, drain in-flight ones (up to --shutdown-timeout), stop."""
        log.info("shutting down: NOT_SERVING, draining %d live requests (up to %.0f s)", len(self.loop.streams),
                 self.config.shutdown_timeout)
        self._stop.set()
        await self.health.enter_graceful_shutdown()
        self.loop.accepting = False
        deadline = asyncio.get_running_loop().time() + self.config.shutdown_timeout
        while self.loop.streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        self.plan_streams.end_all()         # the workers hear an ordered stop, then the server stops
        await self.server.stop(grace=1.0)
        await self.metrics_server.stop()
        await self.loop.kv_pull.close()     # channels to the replicas it pulled from
        for task in self.tasks:
            task.cancel()
        if self.loop.kv_events is not None:
            self.loop.kv_events.close()     # the ZMQ publisher's last batches, then its sockets
        log.info("scheduler stopped")

    async def _watch_health(self) -> None:
        last = None
        while not self._stop.is_set():
            serving = self.loop.is_serving()
            if serving != last:
                status = health_pb2.HealthCheckResponse.SERVING if serving else \
                    health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ("", ENGINE_SERVICE):
                    await self.health.set(name, status)
                if last is not None:
                    log.info("health: %s", "SERVING" if serving else "NOT_SERVING")
                last = serving
            try:
                await asyncio.wait_for(self._stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass


async def serve(sched_config: SchedulerConfig, server_config: ServerConfig) -> bool:
    service = await SchedulerService(sched_config, server_config).start()
    gc_tuning.tune()                        # the process's start-up is done: freeze it, widen the young generation
    log.info("scheduler listening on %s (budget %d tokens/step, max %d seqs)", server_config.address,
             sched_config.max_num_batched_tokens, sched_config.max_num_seqs)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    clean = await service.wait(stop)
    await service.stop()
    return clean


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steploop scheduler", description=__doc__)
    add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    observability.setup("scheduler", args)
    try:
        sched_config, server_config = SchedulerConfig.from_args(args), ServerConfig.from_args(args)
    except ValueError as exc:           # config errors say what to change; no traceback
        parser.exit(2, f"steploop scheduler: {exc}\n")
    sys.exit(0 if event_loop.run(serve(sched_config, server_config)) else 1)
