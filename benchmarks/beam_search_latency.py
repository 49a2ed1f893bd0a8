"""Time of one beam search request (`use_beam_search`, n=4, 64 tokens, ignore_eos so every step runs) against a
running `steploop serve`: the median of a few runs after one warm-up, with the machine's CPU and load.

    python -m benchmarks.beam_search_latency --url http://127.0.0.1:8000 --label in-scheduler

Writes benchmarks/results/beam_search_latency_<label>.json. Measured on the 2-core AMD EPYC shared host (load
9-15): `gateway-path` (the search driven from the gateway as 1-token requests per beam and step, before it moved
into the scheduler) 27.2 s median; `in-scheduler` (beam groups, scheduler/beam_groups.py) 8.0 s."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time
import urllib.request

PROMPT = "The three primary colors are"


def one(url: str, model: str, width: int, max_tokens: int) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "n": width, "use_beam_search": True,
            "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.load(resp)
    elapsed = time.perf_counter() - start
    assert len(out["choices"]) == width and out["usage"]["completion_tokens"] > 0, out
    return elapsed


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--label", required=True)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with urllib.request.urlopen(f"{args.url}/v1/models") as resp:
        model = json.load(resp)["data"][0]["id"]
    one(args.url, model, args.width, args.max_tokens)        # warm-up
    load_before = os.getloadavg()[0]
    times = [one(args.url, model, args.width, args.max_tokens) for _ in range(args.runs)]
    result = {"label": args.label, "width": args.width, "max_tokens": args.max_tokens, "seconds": times,
              "median_s": statistics.median(times), "cpu": cpu_model(), "cores": os.cpu_count(),
              "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}
    out = pathlib.Path(__file__).parent / "results" / f"beam_search_latency_{args.label}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
