"""Routing by KV events vs guessing vs round robin, on 3 real replicas whose caches diverged:
python -m benchmarks.routing_kv_events

Three scheduler replicas (each with its real worker, the default model on the CPU, a small KV pool) behind the
gateway's EngineRouter, driven in-process with token ids. For each router, from the same start (every scheduler
restarted, caches empty):

  1. history: each of P shared prefixes (a "system prompt" of --prefix-len tokens) is sent once through the
     router under test, so the guessing router learns where it sent each one;
  2. divergence, as other traffic and failures do it, bypassing the router: replica 0's cache is evicted by
     filler prompts, replica 1's scheduler restarts (its cache is empty), and every other prefix is also run on
     replica 2 directly (another gateway's users);
  3. measured: R requests (prefix + a unique question) through the router, a few at a time.

Reports the prefix-cache hit rate (cached prompt tokens / prompt tokens, from each request's usage) and the mean
and p50 time to first token, per router, in one run; writes benchmarks/results/routing_kv_events.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from steploop.client import EngineClient, EngineRequest, SamplingParams
from steploop.gateway.routing.router import EngineRouter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "routing_kv_events.json"
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})


class RoundRobinRouter(EngineRouter):
    """The baseline: replicas in turn, whatever they hold."""
    _turn = 0

    def route(self, prompt_ids, cache_salt=""):
        live = [i for i, r in enumerate(self.replicas) if not r.retired]
        self._turn += 1
        start = self._turn % len(live)
        return live[start:] + live[:start], 0, "round-robin"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """One scheduler process and its worker process, logs under the results folder."""

    def __init__(self, index: int, num_kv_blocks: int, log_dir: Path) -> None:
        self.index, self.port, self.log_dir = index, free_port(), log_dir
        self.address = f"127.0.0.1:{self.port}"
        self.num_kv_blocks = num_kv_blocks
        self.scheduler: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    def _spawn(self, name: str, module: str, *args: str) -> subprocess.Popen:
        with open(self.log_dir / f"replica{self.index}-{name}.log", "ab") as log:   # the child keeps its own fd
            return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def start_scheduler(self) -> None:
        self.scheduler = self._spawn("scheduler", "steploop.scheduler", "--scheduler-port", str(self.port),
                                     "--kv-events-config", EVENTS, "--log-stats-interval", "0")

    def start_worker(self) -> None:
        self.worker = self._spawn("worker", "steploop.gpu_worker", "--scheduler-address", self.address,
                                  "--num-kv-blocks", str(self.num_kv_blocks), "--num-threads", "1",
                                  "--max-model-len", "1024")

    def restart_scheduler(self) -> None:
        self.scheduler.kill()
        self.scheduler.wait()
        self.start_scheduler()

    def stop(self) -> None:
        for proc in (self.worker, self.scheduler):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)


async def wait_attached(replicas: list[Replica], timeout: float = 900.0) -> None:
    """Until every scheduler answers a request (its worker attached)."""
    deadline = time.monotonic() + timeout
    for r in replicas:
        while True:
            try:
                await run_one(r.address, [11, 12, 13], f"ready-{r.index}-{time.monotonic()}")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)


async def run_one(address: str, ids: list[int], rid: str) -> int:
    client = EngineClient(address)
    try:
        return await consume(client, ids, rid)
    finally:
        await client.close()


async def consume(engine, ids: list[int], rid: str) -> int:
    cached = 0
    async for chunk in engine.generate(EngineRequest(rid, ids, SamplingParams(max_tokens=1))):
        if chunk.usage is not None:
            cached = chunk.usage.cached_tokens
    return cached


def tokens(seed: int, n: int) -> list[int]:
    return random.Random(seed).sample(range(1000, 40000), n)


async def measure(router: EngineRouter, prefixes: list[list[int]], args, seed: int) -> dict:
    """Phase 3: requests through `router`, --concurrency at a time; per request its TTFT and cached tokens."""
    rng = random.Random(seed)
    work = [(rng.randrange(len(prefixes)), i) for i in range(args.requests)]
    sem, rows = asyncio.Semaphore(args.concurrency), []

    async def one(prefix: int, i: int) -> None:
        ids = prefixes[prefix] + tokens(10_000 + seed * 1000 + i, args.suffix_len)
        async with sem:
            t0 = time.perf_counter()
            cached = await consume(router, ids, f"m{seed}-{i}")
            rows.append({"ttft_s": time.perf_counter() - t0, "cached": cached, "prompt": len(ids)})

    await asyncio.gather(*(one(p, i) for p, i in work))
    ttfts = [r["ttft_s"] for r in rows]
    return {"hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
            "mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts), "requests": len(rows)}


async def diverge(replicas: list[Replica], prefixes: list[list[int]], args) -> None:
    """Phase 2, bypassing the router: evict replica 0, restart replica 1, run half the prefixes on replica 2."""
    filler = args.num_kv_blocks * 16 // (args.prefix_len + args.suffix_len) + 2
    for i in range(filler):
        await run_one(replicas[0].address, tokens(90_000 + i, args.prefix_len + args.suffix_len), f"fill-{i}")
    replicas[1].restart_scheduler()
    for k in range(0, len(prefixes), 2):
        await run_one(replicas[2].address, prefixes[k] + tokens(80_000 + k, 4), f"other-{k}")
    await wait_attached(replicas)


async def bench_router(kind: str, replicas: list[Replica], prefixes: list[list[int]], args, seed: int) -> dict:
    for r in replicas:                                   # the same start for every router: empty caches
        r.restart_scheduler()
    await wait_attached(replicas)
    clients = [EngineClient(r.address) for r in replicas]
    cls = RoundRobinRouter if kind == "round-robin" else EngineRouter
    router = cls(clients, kv_events=kind == "events", health_interval_s=0.5)
    try:
        await router.health()                            # starts health polling and the KV-event watchers
        for k, prefix in enumerate(prefixes):            # phase 1: the history the guess learns from
            await consume(router, prefix + tokens(70_000 + k, 4), f"hist-{kind}-{k}")
        await diverge(replicas, prefixes, args)
        await asyncio.sleep(1.0)                         # let watchers of the restarted replica resync
        return {"router": kind, **await measure(router, prefixes, args, seed)}
    finally:
        await router.close()


async def main_async(args) -> list[dict]:
    log_dir = RESULTS.parent / "routing_kv_events_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    replicas = [Replica(i, args.num_kv_blocks, log_dir) for i in range(3)]
    try:
        for r in replicas:
            r.start_scheduler()
            r.start_worker()
        await wait_attached(replicas)
        prefixes = [tokens(k, args.prefix_len) for k in range(args.prefixes)]
        return [await bench_router(kind, replicas, prefixes, args, seed=1) for kind in args.routers]
    finally:
        for r in replicas:
            r.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=6, help="shared prefixes (system prompts)")
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--requests", type=int, default=24, help="measured requests per router")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=240, help="per replica (16 tokens each)")
    parser.add_argument("--routers", nargs="+", default=["events", "guess", "round-robin"])
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    load = os.getloadavg()[0]
    out = {"config": vars(args), "load_average_1m": round(load, 2), "cpus": os.cpu_count(), "rows": rows}
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"{'router':>12} {'hit rate':>9} {'mean TTFT s':>12} {'p50 TTFT s':>11}")
    for r in rows:
        print(f"{r['router']:>12} {r['hit_rate']:>9.3f} {r['mean_ttft_s']:>12.3f} {r['p50_ttft_s']:>11.3f}")
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs; wrote {RESULTS}")


if __name__ == "__main__":
    main()
