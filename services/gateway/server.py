"""`python -m steploop.gateway`: the gateway process. One aiohttp site on uvloop, graceful shutdown.

Shutdown is a sequence: on SIGTERM/SIGINT /health turns 503 (load balancers stop routing here) and new requests
get 503 + Retry-After while in-flight ones get `--shutdown-timeout` seconds to finish (drain.py); what still runs
then ends with a `shutting_down` error (a stream: an error event, then [DONE]; its engine calls are aborted); then
the listening socket closes and the gRPC channel closes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence

from aiohttp import web

from steploop.common import event_loop, model_path, observability
from steploop.gateway.app import create_app
from steploop.gateway.app_keys import BATCHES, DRAIN, SERVING
from steploop.gateway.config import GatewayConfig, add_cli_args
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing import discovery as discovery_mod
from steploop.gateway.routing.router import EngineRouter
from steploop.gateway.text.tokenizer import load_tokenizer

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


def start_batches(app: web.Application, host: str, port: int) -> None:
    """The Batch API's runner sends each line to this gateway's own endpoint, so it starts once the site listens."""
    loopback = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    app[BATCHES].start(f"http://{loopback}:{port}")


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    path = model_path.resolve_model(config.model)
    tokenizer = await asyncio.to_thread(load_tokenizer, path)
    discovery = None
    if config.scheduler_discovery_interval > 0:       # replicas follow DNS: always the router, maybe empty now
        engine = EngineRouter([], discovered=True, kv_events=config.kv_events_routing,
                              max_migrations=config.max_migrations, kv_pull=config.kv_pull,
                              imbalance=config.balance_abs_threshold)
        targets = [discovery_mod.Target.parse(a) for a in config.scheduler_addresses]
        discovery = discovery_mod.SchedulerDiscovery(engine, targets, discovery_mod.client_factory(
            config.tls, config.engine_session), config.scheduler_discovery_interval)
        await discovery.refresh()
        discovery.start()
    else:
        clients = [EngineClient(address, tls=config.tls, multiplex=config.engine_session)
                   for address in config.scheduler_addresses]
        # One scheduler: no routing layer (and nowhere to migrate to).
        engine = clients[0] if len(clients) == 1 else \
            EngineRouter(clients, kv_events=config.kv_events_routing, max_migrations=config.max_migrations,
                         kv_pull=config.kv_pull, imbalance=config.balance_abs_threshold)
    app = create_app(config, engine, tokenizer)
    # The drain below is the grace period; what outlives it gets 1 s to unwind once the socket closes.
    runner, _ = await start_site(app, config.host, config.port, shutdown_timeout=1.0)
    start_batches(app, config.host, bound_port(runner))
    logger.info("gateway serving %s on http://%s:%d (engine %s)", app[SERVING].model.served_model_name,
                config.host, bound_port(runner), config.scheduler_address)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await app[BATCHES].close()    # no new batch line; those in flight run again at the next start
        logger.info("shutting down: draining %d in-flight requests for up to %.0f s (new ones get 503)",
                    app[DRAIN].in_flight, config.shutdown_timeout)
        left = await app[DRAIN].drain(config.shutdown_timeout)
        if left:
            logger.warning("%d requests still running after %.0f s (--shutdown-timeout); ending them with a "
                           "shutting_down error", left, config.shutdown_timeout)
            await app[DRAIN].cut()    # each stream gets its error event and [DONE] while the socket is open
        await runner.cleanup()    # stop accepting, cancel what is left
    finally:
        if discovery is not None:
            await discovery.stop()
        await engine.close()
        tokenizer.close()
        logger.info("gateway stopped")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steploop gateway",
                                     description="steploop gateway: OpenAI-compatible HTTP API")
    add_cli_args(parser)
    observability.add_cli_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = GatewayConfig.from_args(args)
    except ValueError as exc:           # config errors say what to change; no traceback (exit 2, as argparse)
        parser.exit(2, f"steploop gateway: {exc}\n")
    observability.setup("gateway", args)
    event_loop.run(serve(config))
