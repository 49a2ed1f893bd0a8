"""The soak scenario shared by the CI test and the longer benchmark: N client loops, each sending streamed
completions and behaving badly at random (abort mid-stream, read slowly), for a bounded time."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from tests.integration.cluster import load_report_async

WORDS = "the of and to in is was for on that with as by at from it his an were are which this be".split()


@dataclass
class SoakSettings:
    duration_s: float = 45.0
    concurrency: int = 24
    abort_probability: float = 0.25
    slow_reader_probability: float = 0.2
    seed: int = 0


@dataclass
class SoakReport:
    started: int = 0
    completed: int = 0
    aborted_by_client: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    output_tokens: int = 0
    free_blocks_at_idle: int = -1
    total_blocks: int = -1
    rss_mb: dict[str, float] = field(default_factory=dict)
    rss_growth_mb: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident memory now (VmRSS) or at its peak (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, s: SoakSettings, r: SoakReport):
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": rng.randint(8, 48),
            "temperature": rng.choice([0, 0.8]), "stream": True, "ignore_eos": True}
    abort_after = rng.randint(1, 20) if rng.random() < s.abort_probability else None
    slow = rng.random() < s.slow_reader_probability
    r.started += 1
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status in (429, 503):
            r.rejected += 1
            return
        if resp.status != 200:
            r.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            return
        chunks = 0
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                r.completed += 1
                return
            event = json.loads(line[6:])
            if "error" in event:
                r.errors.append(str(event["error"])[:200])
                return
            chunks += 1
            r.output_tokens += 1
            if abort_after is not None and chunks >= abort_after:
                r.aborted_by_client += 1
                return                      # leaving the block closes the connection mid-stream
            if slow:
                await asyncio.sleep(0.05)
        r.errors.append("stream ended without [DONE]")


async def _client_loop(url: str, seed: int, deadline: float, s: SoakSettings, r: SoakReport):
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            try:
                await _one(session, url, rng, s, r)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                r.errors.append(f"client error: {exc!r}")


async def run_soak(cluster, s: SoakSettings) -> SoakReport:
    report = SoakReport()
    before = {name: rss_mb(p.pid) for name, p in cluster.procs.items()}
    deadline = time.monotonic() + s.duration_s
    await asyncio.gather(*(_client_loop(cluster.base_url, s.seed * 1000 + i, deadline, s, report)
                           for i in range(s.concurrency)))
    for _ in range(100):                     # aborted requests leave within a step; give the engine a moment
        load = await load_report_async(cluster.scheduler_address)
        if load.num_running == load.num_waiting == 0:
            break
        await asyncio.sleep(0.1)
    report.free_blocks_at_idle, report.total_blocks = load.num_free_blocks, load.num_total_blocks
    report.rss_mb = {name: rss_mb(p.pid) for name, p in cluster.procs.items()}
    report.rss_growth_mb = {name: report.rss_mb[name] - before[name] for name in before}
    report.peak_rss_mb = {name: rss_mb(p.pid, "VmHWM") for name, p in cluster.procs.items()}
    return report
