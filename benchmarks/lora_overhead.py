"""What LoRA serving costs in throughput:  python -m benchmarks.lora_overhead [--rounds N] [--output-len N]

Two real clusters (gateway, scheduler and worker processes on loopback, tests/integration/cluster.py, the default
model), started first and kept up:

    plain   no LoRA flags
    lora    --enable-lora --max-loras 4 --lora-modules with four peft adapters (rank 16, q/k/v/o + MLP targets,
            random non-zero B; made here with peft, tests/lora/adapters.py)

Each round sends the same workload three ways, the order rotated each round so drift in the machine's load
spreads over all of them: --concurrency (64) concurrent greedy completions of fresh random token-id prompts
(no prefix-cache hits), ignore_eos, exactly --output-len tokens each:

    base_plain     base-model requests to `plain`
    base_lora      the same base-model requests to `lora` (no adapter in any step: the base path, C decoder too)
    adapters_lora  the same requests spread over the four adapters (16 each), to `lora`

Reports output tok/s per way (median, min-max over rounds) and per-round ratios: base_lora / base_plain (target
>= 0.98) and adapters_lora / base_lora (target on this CPU >= 0.7). Writes benchmarks/results/lora_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import tempfile
import time

RESULTS = pathlib.Path(__file__).parent / "results" / "lora_overhead.json"
WAYS = ("base_plain", "base_lora", "adapters_lora")
ADAPTERS = ("a0", "a1", "a2", "a3")
TARGETS = {"base_lora/base_plain": 0.98, "adapters_lora/base_lora": 0.7}


def make_adapters(out: pathlib.Path) -> dict[str, pathlib.Path]:
    from steploop.common.model_path import default_model_dir
    from tests.lora.adapters import WITH_MLP, AdapterRecipe, make_adapter

    model_dir = default_model_dir()
    targets = tuple(dict.fromkeys(("k_proj", "o_proj") + WITH_MLP))
    return {name: make_adapter(model_dir, out, AdapterRecipe(name, 16, 32, targets, seed=10 + i))
            for i, name in enumerate(ADAPTERS)}


def start_clusters(adapters: dict[str, pathlib.Path], num_kv_blocks: int) -> dict:
    from tests.integration.cluster import Cluster

    lora = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", "16",
            "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    clusters = {"plain": Cluster(pathlib.Path(tempfile.mkdtemp(prefix="lora-bench-plain-")), num_kv_blocks=num_kv_blocks),
                "lora": Cluster(pathlib.Path(tempfile.mkdtemp(prefix="lora-bench-lora-")), scheduler_args=lora,
                                worker_args=lora, gateway_args=["--enable-lora"], num_kv_blocks=num_kv_blocks)}
    try:
        for cluster in clusters.values():
            for name in ("scheduler", "worker", "gateway"):
                cluster.start_service(name)
        for cluster in clusters.values():
            cluster.wait_ready(600)
    except BaseException:
        for cluster in clusters.values():
            cluster.stop()
        raise
    return clusters


async def load(base_url: str, prompts: list[list[int]], models: list[str], output_len: int) -> float:
    """All requests at once (len(prompts) concurrent); returns output tok/s."""
    import aiohttp

    async def one(http, prompt, model) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        async with http.post(base_url + "/v1/completions", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{model}: HTTP {resp.status}: {answer}")
            return answer["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=1800)) as http:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(http, p, m) for p, m in zip(prompts, models)))
        return sum(tokens) / (time.perf_counter() - start)


def measure(args: argparse.Namespace, clusters: dict) -> dict[str, list[float]]:
    from tests.integration.cluster import MODEL

    rng = random.Random(0)
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_index in range(args.rounds + 1):           # round 0 warms up (adapters loaded, caches touched)
        prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
        order = WAYS[round_index % 3:] + WAYS[:round_index % 3]
        for way in order:
            cluster = clusters["plain" if way == "base_plain" else "lora"]
            models = ([ADAPTERS[i % len(ADAPTERS)] for i in range(len(prompts))] if way == "adapters_lora"
                      else [MODEL] * len(prompts))
            shifted = [[(t + 7 * WAYS.index(way)) % 49000 + 100 for t in p] for p in prompts]   # no cross-way hits
            rate = asyncio.run(load(cluster.base_url, shifted, models, args.output_len))
            if round_index:
                rates[way].append(rate)
            print(f"round {round_index}{' (warm-up)' if not round_index else ''} {way}: {rate:.1f} output tok/s",
                  flush=True)
    return rates


def summary(rates: dict[str, list[float]]) -> dict:
    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    ratios = {"base_lora/base_plain": [a / b for a, b in zip(rates["base_lora"], rates["base_plain"])],
              "adapters_lora/base_lora": [a / b for a, b in zip(rates["adapters_lora"], rates["base_lora"])]}
    return {"output_tok_s": {w: spread(v) for w, v in rates.items()},
            "ratios": {k: {**spread(v), "target": TARGETS[k], "meets_target": statistics.median(v) >= TARGETS[k]}
                       for k, v in ratios.items()},
            "per_round": rates}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_overhead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    args = parser.parse_args(argv)
    adapters = make_adapters(pathlib.Path(tempfile.mkdtemp(prefix="lora-bench-adapters-")))
    clusters = start_clusters(adapters, args.num_kv_blocks)
    try:
        result = {"args": vars(args), **summary(measure(args, clusters))}
    finally:
        for cluster in clusters.values():
            cluster.stop()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    for name, ratio in result["ratios"].items():
        print(f"{name}: median {ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f}), "
              f"target >= {ratio['target']}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
