"""Cross-replica KV pull: TTFT of a long prompt cached only on the other replica, pulled vs recomputed, in one run.

Starts two `steploop serve` on the default model (CPU), replicas A and B, whose workers send and receive KV blocks
(--kv-role both, a host tier for received blocks). Each round takes a fresh prompt of --prompt-tokens random tokens
(no replica holds it), runs it on A (one token: now A's pool caches it), then sends it to B's scheduler (Engine
gRPC, no gateway in between) and times its first token: "pull" carries the hint a router with --enable-kv-pull
would attach (A's address and A's block count), "recompute" none. Arms alternate ABBA; the figures are each arm's
median TTFT and their ratio, with the load average before and after (other processes share the cores).

    python -m benchmarks.kv_pull [--rounds 8] [--prompt-tokens 2048] [--base-port 22440]

Writes benchmarks/results/kv_pull.json (commit, machine, flags, load, every round, and B's kv_pull counters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import time

from benchmarks.machine import machine_info
from benchmarks.pd_disagg import Server
from steploop.common.engine_contract import EngineRequest
from steploop.common.kv_pull import KvPullHint
from steploop.common.sampling_params import SamplingParams
from steploop.gateway.engine.engine_client import EngineClient

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VOCAB = (1000, 48000)                 # plain tokens of SmolLM2's 49152 (no special ones)
BLOCK = 16
PULL_METRICS = ("kv_pull_requests_total", "kv_pull_successes_total", "kv_pull_blocks_total", "kv_pull_bytes_total",
                "kv_pull_fallbacks_total", "kv_pull_seconds_total")


async def ttft(address: str, ids: list[int], rid: str, hint: KvPullHint | None = None) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of a one-token greedy request."""
    client = EngineClient(address)
    try:
        start = time.perf_counter()
        first, cached = None, 0
        async for chunk in client.generate(EngineRequest(rid, ids, SamplingParams(max_tokens=1, temperature=0.0),
                                                         kv_pull=hint)):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                cached = chunk.usage.cached_tokens
        return first, cached
    finally:
        await client.close()


async def run_rounds(a: Server, b: Server, args) -> list[dict]:
    rng, rounds = random.Random(args.seed), []
    await ttft(a.address, rng.sample(range(*VOCAB), 64), "warm-a")      # first forwards (allocations) off the clock
    await ttft(b.address, rng.sample(range(*VOCAB), 64), "warm-b")
    for i in range(args.rounds):
        arm = "pull" if i % 4 in (0, 3) else "recompute"                 # ABBA
        ids = rng.sample(range(*VOCAB), args.prompt_tokens)
        source_s, _ = await ttft(a.address, ids, f"a-{i}")
        hint = KvPullHint(a.address, (len(ids) - 1) // BLOCK) if arm == "pull" else None
        seconds, cached = await ttft(b.address, ids, f"b-{i}", hint)
        rounds.append({"round": i, "arm": arm, "ttft_s": seconds, "cached_tokens": cached, "source_s": source_s,
                       "loadavg": pathlib.Path("/proc/loadavg").read_text().split()[:3]})
        print(f"round {i} {arm:9s} TTFT {seconds:7.3f} s  cached {cached:5d}  (A computed it in {source_s:.2f} s)",
              flush=True)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--base-port", type=int, default=22440)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    flags = ["--kv-role", "both", "--kv-offloading-size", "0.5", "--num-kv-blocks", "600",
             "--max-model-len", str(args.prompt_tokens + 64), "--worker-metrics-port", "0"]
    RESULTS.mkdir(exist_ok=True)
    load_before = pathlib.Path("/proc/loadavg").read_text().split()[:3]
    a = Server("kv-pull-a", flags, args.base_port, RESULTS)       # its scheduler: base port + 1
    b = Server("kv-pull-b", flags, args.base_port + 10, RESULTS)
    a.address, b.address = f"127.0.0.1:{args.base_port + 1}", f"127.0.0.1:{args.base_port + 11}"
    try:
        a.wait_ready()
        b.wait_ready()
        rounds = asyncio.run(run_rounds(a, b, args))
        counters = {name: b.metric("steploop:" + name) for name in PULL_METRICS}
    finally:
        a.stop()
        b.stop()
    arms = {arm: statistics.median(r["ttft_s"] for r in rounds if r["arm"] == arm) for arm in ("pull", "recompute")}
    result = {"benchmark": "kv_pull", "machine": machine_info(), "flags": flags, "prompt_tokens": args.prompt_tokens,
              "load_before": load_before, "load_after": pathlib.Path("/proc/loadavg").read_text().split()[:3],
              "median_ttft_s": arms, "recompute_over_pull": arms["recompute"] / arms["pull"], "rounds": rounds,
              "b_counters": counters}
    (RESULTS / "kv_pull.json").write_text(json.dumps(result, indent=2))
    print(f"median TTFT: pull {arms['pull']:.3f} s, recompute {arms['recompute']:.3f} s, recompute/pull "
          f"{result['recompute_over_pull']:.2f}x; load {load_before} -> {result['load_after']}; B: {counters}")


if __name__ == "__main__":
    main()
