"""One migration run: the workload pinned to the victim replica, mid-generation everywhere, then the victim fails
(`fail()`); every stream must complete on the other replicas exactly as an undisturbed run went."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.integration.cluster import is_idle_and_whole, load_report_async
from tests.migration.replicas import Replicas
from tests.migration.workload import run_all, start_all, workload

NUM_ENGINE_REQUESTS = sum(body.get("n", 1) for _, body in workload())   # 18
MIN_EVENTS = 6                  # content events every stream has seen before the victim fails


async def reference(replicas: Replicas) -> list[dict]:
    """The undisturbed run (spread over the replicas as the router likes)."""
    return await run_all(replicas.gateway.base_url)


async def disturbed(replicas: Replicas, victim: int, fail) -> tuple[list[dict], list[int]]:
    """(what each request's client saw, how many events each streamed one had when the victim failed)."""
    await asyncio.to_thread(replicas.pause_all_but, victim)
    address = replicas.clusters[victim].scheduler_address
    async with aiohttp.ClientSession() as http:
        seen, tasks = start_all(replicas.gateway.base_url, http)
        streamed = [s for s, (_, body) in zip(seen, workload()) if body.get("stream")]
        deadline = time.monotonic() + 300
        while not (all(s.events >= MIN_EVENTS for s in streamed)
                   and (await load_report_async(address)).num_running == NUM_ENGINE_REQUESTS):
            assert time.monotonic() < deadline, [s.events for s in streamed]
            assert not any(t.done() for t in tasks), "a request ended before the victim failed"
            await asyncio.sleep(0.2)
        await asyncio.to_thread(replicas.resume_all_but, victim)
        assert not any(t.done() for t in tasks), "a request ended before the victim failed: lengthen the workload"
        at_failure = [s.events for s in streamed]
        await asyncio.to_thread(fail)
        await asyncio.wait_for(asyncio.gather(*tasks), 900)
    return [s.normal() for s in seen], at_failure


def assert_same(got: list[dict], want: list[dict]) -> None:
    for (route, body), g, w in zip(workload(), got, want):
        assert g == w, f"{route} {body.get('prompt') or body['messages'][0]['content']!r}:\n got {g}\nwant {w}"


def assert_reference_is_meaningful(want: list[dict]) -> None:
    """The undisturbed run did what the workload is for: both stop strings matched, n=2 gave two choices, the
    schema's JSON closed, nothing failed."""
    for (_, body), w in zip(workload(), want):
        assert not w["errors"], w
        assert len(w["choices"]) == body.get("n", 1), w
        for choice in w["choices"].values():
            assert len(choice["finish"]) == 1, choice
            if "stop" in body:
                assert choice["finish"] == ["stop"], choice
        if body.get("stream"):
            assert (w["done"], w["usage_events"]) == (1, 1), w


async def assert_survivors_idle(replicas: Replicas, victim: int, timeout: float = 60) -> None:
    """Every replica that took requests over ends with nothing running and every KV block free."""
    for i, c in enumerate(replicas.clusters):
        if i == victim:
            continue
        deadline = time.monotonic() + timeout
        while not is_idle_and_whole(load := await load_report_async(c.scheduler_address)):
            assert time.monotonic() < deadline, f"{c.scheduler_address} not idle and whole: {load}"
            await asyncio.sleep(0.2)
