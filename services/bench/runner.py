"""Drive one benchmark run: arrivals (Poisson / gamma, or as fast as a concurrency cap allows), a progress bar,
and the metrics at the end.

Arrivals follow vLLM: inter-arrival times are Gamma(shape=burstiness, scale=1 / (rate * burstiness)), so
burstiness 1 is a Poisson process; rate inf sends everything at once (then --max-concurrency paces it).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import numpy as np

from steploop.bench.client import Target, send_request
from steploop.bench.datasets import SampleRequest
from steploop.bench.metrics import RequestResult, compute_metrics
from steploop.common import event_loop


def arrival_intervals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each of n requests (the first included)."""
    if rate == float("inf") or rate <= 0:
        return [0.0] * n
    if burstiness <= 0:
        raise ValueError(f"--burstiness {burstiness} must be > 0")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


async def arrivals(requests: list[SampleRequest], rate: float, burstiness: float,
                   seed: int) -> AsyncIterator[SampleRequest]:
    for req, wait in zip(requests, arrival_intervals(len(requests), rate, burstiness, seed)):
        if wait > 0:
            await asyncio.sleep(wait)
        yield req


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        self.total, self.done, self.enabled = total, 0, enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            print(f"\r{self.done}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def run_sync(coro):
    """Runs a load-generating coroutine to completion on uvloop when it is installed, else on asyncio's default
    loop. The client shares the machine with the server under test, so its CPU counts: at 64 streams uvloop
    cut it by ~10% (0.33 -> 0.30 s per 20 s run)."""
    return event_loop.run(coro)


async def run(target: Target, requests: list[SampleRequest], *, request_rate: float = float("inf"),
              burstiness: float = 1.0, max_concurrency: int | None = None, warmups: list[SampleRequest] = (),
              seed: int = 0, tokenizer=None, slos: dict | None = None, percentiles=(50.0, 90.0, 99.0),
              progress: bool = True) -> tuple[dict, list[RequestResult]]:
    """Warm-ups first (one at a time, not measured), then the measured requests. Returns (summary, results)."""
    limit = max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, force_close=False, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        for req in warmups:
            res = await send_request(session, target, req, tokenizer)
            if not res.success:
                raise RuntimeError(f"warm-up request failed: {res.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = Progress(len(requests), progress)

        async def one(req: SampleRequest) -> RequestResult:
            if sem is None:
                res = await send_request(session, target, req, tokenizer)
            else:
                async with sem:
                    res = await send_request(session, target, req, tokenizer)
            bar.update()
            return res

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in arrivals(requests, request_rate, burstiness, seed)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    summary = compute_metrics(results, duration, slos, percentiles)
    summary.update(request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency)
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:10]
    return summary, results
