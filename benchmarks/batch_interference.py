"""Interactive TTFT with and without a Batch API job running, in one run, alternating rounds.

Starts `steploop serve` (default model, CPU, the scheduler under --scheduling-policy, fcfs by default: batch lines
are background requests under every policy, admitted after interactive requests, preempted first, and their
prompt chunks leave the step budget to waiting interactive requests), then per round: a baseline
phase (interactive requests only) and a batch phase (the same interactive load while a batch of --batch-lines
chat requests runs). Interactive load: --requests streamed completions, one every --interval s, each timed to
its first token. Writes results/batch_interference_<policy>.json with p50/p99 per phase and their ratio (goal p99
<= 1.3x).

    python -m benchmarks.batch_interference --rounds 2 [--scheduling-policy priority]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

import openai

from benchmarks.machine import git_commit, machine_info

MODEL = "SmolLM2-135M-Instruct"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ttft(client: openai.AsyncOpenAI, i: int) -> float:
    start = time.perf_counter()
    stream = await client.completions.create(model=MODEL, prompt=f"Interactive question {i}: the sky is",
                                             max_tokens=8, temperature=0, stream=True)
    first = None
    async for _ in stream:
        first = first or time.perf_counter() - start
    return first


async def _interactive(client, n: int, interval: float) -> list[float]:
    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(_ttft(client, i)))
        await asyncio.sleep(interval)
    return list(await asyncio.gather(*tasks))


async def _phase(client, args, with_batch: bool, round_no: int) -> dict:
    batch = None
    if with_batch:
        lines = [{"custom_id": f"r{round_no}-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "max_tokens": args.batch_tokens,
                           "messages": [{"role": "user", "content": f"Write a sentence about the number {i}."}]}}
                 for i in range(args.batch_lines)]
        data = io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())
        data.name = "batch.jsonl"
        file = await client.files.create(file=data, purpose="batch")
        batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        while (await client.batches.retrieve(batch.id)).request_counts.completed < args.batch_concurrency:
            await asyncio.sleep(0.2)     # the batch is running at full width before the interactive load starts
    ttfts = await _interactive(client, args.requests, args.interval)
    done = None
    if batch is not None:
        done = (await client.batches.retrieve(batch.id)).request_counts.completed
        await client.batches.cancel(batch.id)
        while (await client.batches.retrieve(batch.id)).status != "cancelled":
            await asyncio.sleep(0.2)
    q = statistics.quantiles(ttfts, n=100)
    return {"with_batch": with_batch, "round": round_no, "p50_s": statistics.median(ttfts), "p99_s": q[98],
            "batch_lines_done_during": done, "ttfts_s": ttfts}


async def _run(args, url: str) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    await _interactive(client, 4, 0.0)                                   # warm-up
    phases = []
    for r in range(args.rounds):
        for with_batch in (False, True) if r % 2 == 0 else (True, False):   # alternate which goes first
            phases.append(await _phase(client, args, with_batch, r))
            p = phases[-1]
            print(f"round {r} {'batch   ' if with_batch else 'baseline'}: TTFT p50 {p['p50_s'] * 1e3:.0f} ms, "
                  f"p99 {p['p99_s'] * 1e3:.0f} ms", flush=True)
    return phases


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"steploop serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("steploop serve did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=30, help="interactive requests per phase")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between interactive requests")
    parser.add_argument("--batch-lines", type=int, default=400)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--batch-concurrency", type=int, default=8)
    parser.add_argument("--batch-dir", default=None, help="default: a fresh folder under /tmp")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    batch_dir = args.batch_dir or f"/tmp/steploop-bench-batches-{os.getpid()}"
    log = open(f"/tmp/steploop-bench-serve-{os.getpid()}.log", "wb")   # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen([sys.executable, "-m", "steploop.cli", "serve", "--port", str(port),
                             "--scheduler-port", str(_free_port()), "--scheduling-policy", args.scheduling_policy,
                             "--batch-dir", batch_dir, "--batch-concurrency", str(args.batch_concurrency)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, proc)
        phases = asyncio.run(_run(args, url))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    summary = {}
    for kind in (False, True):
        sel = [p for p in phases if p["with_batch"] is kind]
        summary["batch" if kind else "baseline"] = {"p50_s": statistics.median(p["p50_s"] for p in sel),
                                                    "p99_s": statistics.median(p["p99_s"] for p in sel)}
    summary["p99_ratio"] = summary["batch"]["p99_s"] / summary["baseline"]["p99_s"]
    summary["p50_ratio"] = summary["batch"]["p50_s"] / summary["baseline"]["p50_s"]
    result = {"machine": machine_info(), "commit": git_commit(), "args": vars(args), "summary": summary,
              "phases": phases}
    out = RESULTS / f"batch_interference_{args.scheduling_policy}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
