"""The gateway's /metrics: its own HTTP metrics (requests by route, method and status; latency) followed by the
scheduler's engine metrics (vllm:*, steploop:*, fetched with Engine.GetMetrics), in one scrape as on a vLLM
server (with several scheduler replicas, each sample labelled with its replica). The same outermost middleware opens the HTTP request's span when tracing is on.

`install(app, engine, model)` wires it into an app; create_app calls it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from steploop.common import metrics, tracing
from steploop.gateway import tracing as gateway_tracing
from steploop.gateway.app_keys import IMAGE_PROMPTS
from steploop.gateway.routing.router import EngineRouter

log = logging.getLogger(__name__)

# prometheus-fastapi-instrumentator's names and buckets (what vLLM's API server exposes).
HTTP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
IMAGE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
UNMATCHED = "none"


class GatewayMetrics:
    def __init__(self, engine: Any, model: Any) -> None:
        self.engine = engine
        self.model = model                            # ModelState: served_model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                ["handler", "method", "status"], registry=self.registry)
        self.latency = Histogram("http_request_duration_seconds", "Latency of HTTP requests (whole stream).",
                                 ["handler", "method"], buckets=HTTP_BUCKETS, registry=self.registry)
        self.request_images: Histogram | None = None   # install(): with metrics on and a model that takes images

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else UNMATCHED
        if route == "/metrics":
            return await handler(request)
        start, status = time.perf_counter(), 500
        span = gateway_tracing.start_http(request, route, self.model.served_model_name) if tracing.ENABLED else None
        try:
            if span is None:
                response = await handler(request)
            else:
                from opentelemetry.trace import use_span
                with use_span(span, end_on_exit=False):
                    response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499                               # the client went away (nginx's code for it)
            raise
        finally:
            self.requests.labels(route, request.method, str(status)).inc()
            self.latency.labels(route, request.method).observe(time.perf_counter() - start)
            if span is not None:
                gateway_tracing.end_http(span, status)

    async def handle(self, request: web.Request) -> web.Response:
        body = metrics.exposition(self.registry)
        if isinstance(self.engine, EngineRouter):
            body += metrics.exposition(self.engine.migration.registry)   # steploop:request_migrations_total
            body += labelled_by_replica(await self.engine.metrics_texts(), self.engine.replica_samples())
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
        try:
            body += (await self.engine.metrics_text()).encode()
        except Exception as err:  # noqa: BLE001 - the scheduler is down: still show the gateway's own
            log.debug("engine metrics unavailable: %s", err)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def labelled_by_replica(texts: list[tuple[str, str]], router_samples=()) -> bytes:
    """Several schedulers' expositions as one: each family once, every sample with a `replica` label (its
    address), so one scrape of the gateway still shows every replica and sum() by model_name adds them up; then
    the router's own per-replica series (up, in flight, routed), which also name a replica that does not answer."""
    families: dict[str, Metric] = {}
    for name, kind, doc, values in router_samples:
        family = families[name] = Metric(name, doc, kind)
        for address, value in values.items():
            family.add_sample(name + ("_total" if kind == "counter" else ""), {"replica": address}, value)
    for address, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": address}, sample.value, sample.timestamp,
                                  sample.exemplar)

    class Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)


METRICS = web.AppKey("metrics", GatewayMetrics)


def install(app: web.Application, engine: Any, model: Any) -> GatewayMetrics:
    """Under --disable-log-stats there is no middleware (no HTTP metrics, no spans: the flag excludes tracing);
    /metrics still answers, with no samples."""
    gm = app[METRICS] = GatewayMetrics(engine, model)
    if metrics.ENABLED:
        app.middlewares.insert(0, gm.middleware)      # outermost: sees the final status of every request
        if IMAGE_PROMPTS in app and app[IMAGE_PROMPTS].processor is not None:
            # requests that carry images only (vLLM has no such family); fed by ImagePrompts.prepare
            gm.request_images = Histogram("steploop:request_images", "Images per request that carries images.",
                                          buckets=IMAGE_BUCKETS, registry=gm.registry)
            app[IMAGE_PROMPTS].on_images = gm.request_images.observe
    app.router.add_get("/metrics", gm.handle)
    return gm
