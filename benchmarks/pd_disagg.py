"""Prefill/decode disaggregation: long prompts arriving while streams decode, P/D vs one group, in one run.

Starts two `steploop serve` on the default model (CPU): "one_group" (one worker runs prompts and decodes) and
"pd" (--disaggregated-prefill --disagg-policy cost: a decode worker and a prefill worker, each with half the
cores, as serve gives them by default). Three setups: "one_group"; "pd", the long prompts forced disaggregated
(the request's `disaggregation` field); "pd_cost", the same server choosing per request by its step-cost models
(pd_choice.py). Per phase, on one setup: --streams streamed greedy requests with short prompts decode (ignore_eos);
once all of them emit tokens, --settle seconds of streams alone, then --long-prompts prompts of --prompt-tokens
random tokens (unique per phase: no prefix hit), one every --long-interval seconds, each timed to its first token
(TTFT). The window runs from the first long prompt's arrival until the last one's first token; the streams'
inter-token gaps (ITL) that end in it are the measured ones, those before it the "alone" ones. Then the streams
are closed (an abort), and the next phase starts once the server is idle. Setups alternate ABCCBA per round;
each setup's figures are the median over its phases of each phase's median and p99 ITL, and the median TTFT.

    python -m benchmarks.pd_disagg [--rounds 2] [--base-port 19400]

Writes benchmarks/results/pd_disagg.json (commit, CPU model and flags, load, both setups' flags, every phase).
On a machine of few cores both setups share the same cores: the prefill worker's forward takes CPU time the
decode worker would otherwise use, so this measures scheduling (a decode step never waits behind a prompt chunk),
not the extra hardware P/D has where it is deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import aiohttp

from benchmarks.machine import machine_info
from tests.observability.scrape import parse, value_or_zero

MODEL = "SmolLM2-135M-Instruct"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VOCAB = (1000, 48000)                 # plain tokens of SmolLM2's 49152 (no special ones)
PD_METRICS = ("pd_disaggregated_requests_total", "pd_kv_transfers_total", "pd_fallbacks_total",
              "pd_kv_transfer_failures_total", "pd_kv_transfer_bytes_total", "pd_kv_transfer_seconds_total")


def setup_flags(args) -> dict[str, list[str]]:
    # --kv-transfer-lease bounds a prefill step too (it includes the send): a 2048-token chunk on one thread of a
    # loaded 2-core machine took over the 60 s default.
    common = ["--num-kv-blocks", str(args.num_kv_blocks), "--kv-offloading-size", str(args.kv_offloading_size),
              "--worker-metrics-port", "0", "--kv-transfer-lease", str(args.kv_transfer_lease)]
    return {"one_group": common, "pd": [*common, "--disaggregated-prefill", "--disagg-policy", "cost"]}


SETUPS = {"one_group": ("one_group", ""), "pd": ("pd", "disaggregated"), "pd_cost": ("pd", "")}  # server, field


class Server:
    def __init__(self, name: str, flags: list[str], port: int, log_dir: pathlib.Path):
        self.name, self.flags, self.url = name, flags, f"http://127.0.0.1:{port}"
        self.log = open(log_dir / f"pd-bench-{name}.log", "wb")    # noqa: SIM115 - the server's whole life
        self.proc = subprocess.Popen([sys.executable, "-m", "steploop.cli", "serve", "--port", str(port),
                                      "--scheduler-port", str(port + 1), "--metrics-port", str(port + 2), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            return parse(resp.read().decode())

    def metric(self, name: str) -> float:
        return value_or_zero(self.metrics(), name)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: steploop serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200 and ("--disaggregated-prefill" not in self.flags
                                               or self.metric("steploop:pd_prefill_group_up") == 1.0):
                        return
            except OSError:
                pass
            time.sleep(0.5)                   # a poll interval
        raise TimeoutError(f"{self.name}: steploop serve did not become ready")

    def wait_idle(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = value_or_zero(m, "vllm:num_requests_running") + value_or_zero(m, "vllm:num_requests_waiting")
            if busy == 0 and value_or_zero(m, "steploop:pd_prefill_requests") == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: not idle after {timeout} s")
            time.sleep(0.2)                   # a poll interval

    def stop(self) -> None:
        """SIGTERM; a second one if streams are still open (serve's gateway waits for them), then SIGKILL."""
        for _ in range(2):
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                 times: list[float], mode: str = "") -> None:
    """Appends the arrival time of every streamed chunk. mode: the request's `disaggregation` field."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **({"disaggregation": mode} if mode else {})}
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def phase(server: Server, args, rng: random.Random, setup: str) -> dict:
    mode = SETUPS[setup][1]
    before = server.metrics()
    connector = aiohttp.TCPConnector(limit=args.streams + args.long_prompts + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as client:
        times: list[list[float]] = [[] for _ in range(args.streams)]
        tasks = [asyncio.ensure_future(stream(client, server.url, [rng.randrange(*VOCAB) for _ in range(args.stream_prompt_tokens)],
                                              args.stream_tokens, times[i])) for i in range(args.streams)]
        deadline = time.monotonic() + 600
        while min(len(t) for t in times) < 3:
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                raise RuntimeError(f"{server.name}: the streams did not all start decoding")
            await asyncio.sleep(0.05)        # a poll interval
        await asyncio.sleep(args.settle)     # the streams alone: the reference gaps
        t0 = time.perf_counter()
        long_times: list[list[float]] = [[] for _ in range(args.long_prompts)]
        sent: list[float] = []
        longs = []
        for i in range(args.long_prompts):
            if i:
                await asyncio.sleep(max(0.0, t0 + i * args.long_interval - time.perf_counter()))
            sent.append(time.perf_counter())
            prompt = [rng.randrange(*VOCAB) for _ in range(args.prompt_tokens)]
            longs.append(asyncio.ensure_future(stream(client, server.url, prompt, args.long_tokens, long_times[i],
                                                      mode)))
        await asyncio.gather(*longs)
        t1 = max(t[0] for t in long_times)
        if any(t.done() for t in tasks):
            raise RuntimeError(f"{server.name}: a stream ended inside the window; raise --stream-tokens")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    server.wait_idle()
    after = server.metrics()
    alone, loaded = [], []
    for ts in times:
        for a, b in itertools.pairwise(ts):
            if b <= t0:
                alone.append(b - a)
            elif b <= t1:
                loaded.append(b - a)
    ttfts = [t[0] - s for t, s in zip(long_times, sent)]
    return {"setup": setup, "window_s": t1 - t0, "ttft_s": ttfts,
            "itl": {"median_s": statistics.median(loaded), "p99_s": pct(loaded, 0.99), "max_s": max(loaded),
                    "samples": len(loaded)},
            "itl_alone": {"median_s": statistics.median(alone), "p99_s": pct(alone, 0.99), "samples": len(alone)},
            "pd": {m: value_or_zero(after, f"steploop:{m}") - value_or_zero(before, f"steploop:{m}")
                   for m in PD_METRICS},
            "decisions": {c: value_or_zero(after, "steploop:pd_decisions_total", choice=c)
                          - value_or_zero(before, "steploop:pd_decisions_total", choice=c)
                          for c in ("disaggregated", "local")},
            "load_average": os.getloadavg()}


def summarize(phases: list[dict]) -> dict:
    out = {}
    for name in SETUPS:
        sel = [p for p in phases if p["setup"] == name]
        out[name] = {"itl_p99_s": statistics.median(p["itl"]["p99_s"] for p in sel),
                     "itl_median_s": statistics.median(p["itl"]["median_s"] for p in sel),
                     "itl_alone_p99_s": statistics.median(p["itl_alone"]["p99_s"] for p in sel),
                     "itl_alone_median_s": statistics.median(p["itl_alone"]["median_s"] for p in sel),
                     "ttft_median_s": statistics.median(t for p in sel for t in p["ttft_s"]),
                     "phases": len(sel)}
    for name in ("pd", "pd_cost"):
        out[f"{name}_over_one_group"] = {k: out[name][k] / out["one_group"][k]
                                         for k in ("itl_p99_s", "itl_median_s", "ttft_median_s")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="each round runs every setup twice (ABCCBA)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-prompt-tokens", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=3000, help="max_tokens of a stream (closed after the window)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of each long prompt")
    ap.add_argument("--long-prompts", type=int, default=2, help="long prompts per phase")
    ap.add_argument("--long-interval", type=float, default=5.0, help="seconds between long prompts")
    ap.add_argument("--long-tokens", type=int, default=4, help="max_tokens of a long prompt")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of streams alone before the long prompts")
    ap.add_argument("--num-kv-blocks", type=int, default=3000)
    ap.add_argument("--kv-offloading-size", type=float, default=0.5, help="GiB (the decode worker's landing area)")
    ap.add_argument("--kv-transfer-lease", type=float, default=600.0)
    ap.add_argument("--base-port", type=int, default=19400, help="one_group: base..base+2, pd: base+10..base+12")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "pd_disagg.json"))
    args = ap.parse_args()
    info = machine_info()             # its commit: the code measured (read before the run, not after it)
    flags = setup_flags(args)
    log_dir = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    servers = {name: Server(name, f, args.base_port + 10 * i, log_dir) for i, (name, f) in enumerate(flags.items())}
    rng = random.Random(args.seed)
    phases = []
    try:
        for s in servers.values():
            s.wait_ready()
        for name in ("one_group", "pd"):  # one discarded phase per server: first shapes run slower
            asyncio.run(phase(servers[name], argparse.Namespace(**{**vars(args), "long_prompts": 1, "settle": 1.0}),
                              rng, name))
        order = list(SETUPS)
        for r in range(args.rounds):
            names = order + order[::-1] if r % 2 == 0 else order[::-1] + order
            for name in names:
                p = asyncio.run(phase(servers[SETUPS[name][0]], args, rng, name))
                phases.append(p)
                print(f"round {r} {name:9s}: ITL p99 {p['itl']['p99_s'] * 1e3:6.0f} ms, median "
                      f"{p['itl']['median_s'] * 1e3:5.0f} ms (alone p99 {p['itl_alone']['p99_s'] * 1e3:5.0f}, "
                      f"median {p['itl_alone']['median_s'] * 1e3:4.0f}); TTFT "
                      f"{', '.join(f'{t:.1f}' for t in p['ttft_s'])} s; transfers {p['pd']['pd_kv_transfers_total']:.0f},"
                      f" fallbacks {p['pd']['pd_fallbacks_total']:.0f}, chosen disaggregated "
                      f"{p['decisions']['disaggregated']:.0f}; load {p['load_average'][0]:.1f}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = summarize(phases)
    result = {"benchmark": "pd_disagg", "model": MODEL, "machine": info, "commit": info["commit"], "args": vars(args),
              "setup_flags": flags, "load_average_at_end": os.getloadavg(), "summary": summary, "phases": phases}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
