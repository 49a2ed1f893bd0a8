"""`python -m services.gateway`: the gateway process. One aiohttp site on uvloop, graceful shutdown.

Shutdown is a sequence: on SIGTERM/SIGINT /health turns 503 (load balancers stop routing here), the listening
socket closes, in-flight requests get `--shutdown-timeout` seconds to finish, then the rest are cancelled (which
aborts their engine calls) and the gRPC channel closes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence

from aiohttp import web

from services.common import event_loop, model_path, observability
from services.gateway import routes
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig, add_cli_args
from services.gateway.engine_client import EngineClient
from services.gateway.tokenizer import load_tokenizer

logger = logging.getLogger("steploop.gateway")


async def start_site(app: web.Application, host: str, port: int,
                     shutdown_timeout: float) -> tuple[web.AppRunner, web.TCPSite]:
    """Starts serving `app`. handler_cancellation: a closed HTTP connection cancels its handler, and with it
    the engine call (the request is aborted) instead of generating for nobody."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site


def bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    path = model_path.resolve_model(config.model)
    tokenizer = await asyncio.to_thread(load_tokenizer, path)
    engine = EngineClient(config.scheduler_address, tls=config.tls, multiplex=config.engine_session)
    app = create_app(config, engine, tokenizer)
    runner, _ = await start_site(app, config.host, config.port, config.shutdown_timeout)
    logger.info("gateway serving %s on http://%s:%d (engine %s)", app[routes.SERVING].model.served_model_name,
                config.host, bound_port(runner), config.scheduler_address)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logger.info("shutting down: draining in-flight requests for up to %.0f s", config.shutdown_timeout)
        app[routes.HEALTH].draining = True
        await runner.cleanup()    # stop accepting, wait for in-flight handlers, cancel the rest
    finally:
        await engine.close()
        tokenizer.close()
        logger.info("gateway stopped")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway",
                                     description="steploop gateway: OpenAI-compatible HTTP API")
    add_cli_args(parser)
    observability.add_cli_args(parser)
    args = parser.parse_args(argv)
    config = GatewayConfig.from_args(args)
    observability.setup("gateway", args)
    event_loop.run(serve(config))
