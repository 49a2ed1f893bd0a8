"""Prometheus plumbing shared by the services: vLLM's bucket boundaries, a histogram fed in batches, a tiny
aiohttp /metrics server. Each service owns its own CollectorRegistry (never the process-global default), so
several services (or tests) in one process never collide.

Hot paths never touch prometheus_client: a step appends plain floats to `BatchHistogram.pending` and bumps
ints; a collector turns them into metric families only when scraped.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily

log = logging.getLogger(__name__)

# False under --disable-log-stats (set by observability.setup before a service builds anything): the services
# build no-op observers instead of their metric recorders, and /metrics answers with no samples.
ENABLED = True

# The boundaries vLLM's V1 engine uses (vllm/v1/metrics/loggers.py), so dashboards' quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# steploop's own sub-second timings (schedule, forward, transport).
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets, for token-count histograms)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


class BatchHistogram:
    """A histogram whose observations are appended to `pending` (one list append, no lock, no bisect) and
    folded into bucket counts when scraped, or when more than FOLD_AT are pending."""

    FOLD_AT = 4096
    __slots__ = ("bounds", "count", "counts", "pending", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # the last is +Inf
        self.sum = 0.0
        self.count = 0
        self.pending: list[float] = []

    def observe(self, value: float) -> None:
        self.pending.append(value)

    def observe_many(self, values: list[float]) -> None:
        self.pending.extend(values)
        if len(self.pending) > self.FOLD_AT:
            self.fold()

    def fold(self) -> None:
        pending, self.pending = self.pending, []
        bounds, counts = self.bounds, self.counts
        for value in pending:
            counts[bisect_left(bounds, value)] += 1   # first bound >= value: Prometheus' `le`
        self.sum += sum(pending)
        self.count += len(pending)

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        self.fold()
        cumulative, buckets = 0, []
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else _fmt(bound), cumulative))
        family.add_metric(labels, buckets, self.sum)


def _fmt(bound: float) -> str:
    return str(int(bound)) + ".0" if bound == int(bound) else repr(bound)


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format 0.0.4."""
    return generate_latest(registry)


class MetricsServer:
    """GET /metrics on its own port (aiohttp, in the service's event loop). A port already taken is logged,
    not fatal: metrics must never take a serving process down."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.registry = registry
        self.service = service
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        try:
            site = web.TCPSite(self.runner, host, port)
            await site.start()
        except OSError as exc:
            log.error("%s metrics: cannot listen on %s:%d (%s); /metrics is off", self.service, host, port, exc)
            await self.stop()
            return self
        self.port = self.runner.addresses[0][1]
        log.info("%s metrics on http://%s:%d/metrics", self.service, host, self.port)
        return self

    async def _handle(self, request: web.Request) -> web.Response:
        return web.Response(body=exposition(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
