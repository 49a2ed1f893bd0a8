"""KV disk tier across a real SIGKILL (kv_tiers.py --only disk_sigkill): `steploop serve` with host and disk tiers,
a long prompt served, its blocks pushed below the pool and host memory (other long prompts), `kill -9` of the
worker process, the supervisor's restart; then that prompt's TTFT restored from the dead worker's disk files vs the
TTFT of a cold prompt of the same length, alternating which goes first (ABBA), a few rounds.

Requests go through the scheduler's gRPC Engine API (token ids: exact lengths), TTFT = the first chunk with a
token. After each restart one short warm-up request runs first, so neither measured prompt pays the new process's
first-forward costs. The block files stay in the page cache across a process kill (as they would on a real host);
--sigkill-cold-files drops them from it (posix_fadvise DONTNEED after fsync), as after a reboot.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

from steploop.client import EngineClient, EngineRequest, SamplingParams

BLOCK = 16
BLOCK_BYTES = 737_280          # the default model's KV block, float32 (README: 720 KiB)
PORTS = {"--port": 22600, "--scheduler-port": 22601, "--metrics-port": 22602}   # this benchmark's own range


def serve_argv(disk: str, prompt: int) -> tuple[list[str], int, int]:
    """`steploop serve` sized so one long prompt fills most of the pool and host memory holds one too (a disk
    prompt is promoted to host whole, then loaded). Returns (argv, pool blocks, host blocks)."""
    blocks = prompt // BLOCK + 2
    pool = blocks + 8                           # + the null block, the output, a little slack
    host_gib = (blocks + 4) * BLOCK_BYTES / 2**30
    argv = [sys.executable, "-m", "steploop.cli", "serve", "--num-kv-blocks", str(pool),
            "--max-model-len", str((pool - 1) * BLOCK), "--kv-offloading-size", f"{host_gib:.6f}",
            "--kv-disk-path", disk, "--kv-disk-size", "4", "--worker-metrics-port", "0"]
    for flag, port in PORTS.items():
        argv += [flag, str(port)]
    return argv, pool, int(host_gib * 2**30) // BLOCK_BYTES


def metric(name: str, **labels: str) -> float:
    """A counter from the scheduler's /metrics (0 when absent)."""
    url = f"http://127.0.0.1:{PORTS['--metrics-port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def worker_pid(serve: subprocess.Popen) -> int | None:
    for child in psutil.Process(serve.pid).children():
        if "steploop.gpu_worker" in " ".join(child.cmdline()):
            return child.pid
    return None


async def wait_for(condition, what: str, timeout: float, serve: subprocess.Popen, log: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if serve.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"serve: {what} did not happen; log tail:\n{log.read_text()[-3000:]}")
        await asyncio.sleep(0.2)                           # a poll interval


def safe_metric(name: str, **labels: str) -> float | None:
    try:
        return metric(name, **labels)
    except OSError:
        return None


async def ttft(client: EngineClient, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of a 1-token greedy request, and the cached prompt tokens it reported."""
    start = time.perf_counter()
    first, cached = None, 0
    request = EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    async for chunk in client.generate(request):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            cached = chunk.usage.cached_tokens
    return first, cached


def drop_from_page_cache(disk: str) -> int:
    n = 0
    for f in pathlib.Path(disk).rglob("*.kvb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


class Serve:
    """A `steploop serve` process tree on this benchmark's ports, its output in a log file."""

    def __init__(self, disk: str, prompt: int, log: pathlib.Path) -> None:
        self.argv, self.pool_blocks, self.host_blocks = serve_argv(disk, prompt)
        self.log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # so `finally: stop()` runs on a timeout
        self.address = f"127.0.0.1:{PORTS['--scheduler-port']}"

    async def wait_attached(self, attaches: float, timeout: float = 300.0) -> None:
        await wait_for(lambda: (safe_metric("steploop:worker_attaches_total") or 0) > attaches
                       and (safe_metric("steploop:workers_attached") or 0) >= 1, "a worker attach", timeout,
                       self.proc, self.log)

    async def kill_worker(self) -> float:
        """SIGKILL the worker; seconds until the supervisor's new worker attached to the scheduler."""
        before = metric("steploop:worker_attaches_total")
        pid = worker_pid(self.proc)
        assert pid is not None, "no worker process under serve"
        start = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        await self.wait_attached(before)
        new = worker_pid(self.proc)
        assert new is not None and new != pid, f"the worker was not restarted (pid {pid} -> {new})"
        return time.perf_counter() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def disk_sigkill(prompt_len: int, rounds: int, cold_files: bool = False, log_dir: str | None = None) -> dict:
    log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="kv_sigkill_"))
    with tempfile.TemporaryDirectory() as disk:
        serve = Serve(disk, prompt_len, log_dir / "serve.log")
        try:
            out = asyncio.run(measure(serve, disk, prompt_len, rounds, cold_files))
        finally:
            serve.stop()
    disk_med = statistics.median(x["ttft_s"] for x in out["rounds"]["disk"])
    cold_med = statistics.median(x["ttft_s"] for x in out["rounds"]["cold"])
    out.update(prompt_tokens=prompt_len, pool_blocks=serve.pool_blocks, host_blocks=serve.host_blocks,
               cold_files=cold_files, serve_argv=serve.argv[2:], disk_ttft_s=disk_med, cold_ttft_s=cold_med,
               cold_over_disk=cold_med / disk_med, log=str(log_dir / "serve.log"),
               cold_over_disk_per_round=[c["ttft_s"] / d["ttft_s"]
                                         for c, d in zip(out["rounds"]["cold"], out["rounds"]["disk"])])
    return out


async def measure(serve: Serve, disk: str, prompt_len: int, rounds: int, cold_files: bool) -> dict:
    """Each round: the kill and restart, a warm-up, then the prompt served before the kill (from disk) and a new
    one (cold), in ABBA order. The cold one is the next round's prompt: the fillers push it to disk first."""
    rng = random.Random(5)
    tokens = lambda n: [rng.randrange(100, 40000) for _ in range(n)]
    # Pushing a prompt's blocks out of the pool and host memory takes newer blocks than both hold.
    filler_tokens = (serve.pool_blocks + serve.host_blocks + 8) * BLOCK
    fillers = [prompt_len] * (filler_tokens // prompt_len) + [filler_tokens % prompt_len or BLOCK]
    runs = {"disk": [], "cold": []}
    restarts, first_cold = [], None
    await serve.wait_attached(0)
    client = EngineClient(serve.address)
    try:
        prompt = tokens(prompt_len)
        first_cold, _ = await ttft(client, "first", prompt)
        for r in range(rounds):
            for i, n in enumerate(fillers):
                await ttft(client, f"f{r}.{i}", tokens(n))
            restarts.append(await serve.kill_worker())
            dropped = drop_from_page_cache(disk) if cold_files else 0
            await ttft(client, f"w{r}", tokens(BLOCK))            # the new process's warm-up
            cold = tokens(prompt_len)
            for mode in (("disk", "cold") if r % 2 == 0 else ("cold", "disk")):
                hits = metric("steploop:kv_tier_hits_total", medium="DISK")
                load = os.getloadavg()[0]
                t, cached = await ttft(client, f"{mode}{r}", prompt if mode == "disk" else cold)
                runs[mode].append({"ttft_s": t, "disk_hit_tokens": metric("steploop:kv_tier_hits_total",
                                                                          medium="DISK") - hits,
                                   "cached_tokens": cached, "load_1m": load, "files_dropped": dropped})
                print(f"  round {r} {mode}", runs[mode][-1], flush=True)
            prompt = cold
    finally:
        await client.close()
    return {"rounds": runs, "restart_to_attach_s": restarts, "first_cold_ttft_s": first_cold,
            "filler_tokens": fillers}
