"""Cluster: gateway, scheduler and worker as real processes on loopback, for integration tests.

Each service runs as `python -m steploop.<name>` with explicit flags, its output in a log file under the test's
tmp dir (printed when start-up fails). Ports are picked free at start. `modules` runs a service from another
module with the same flags (e.g. the worker from tests/integration/faulty_worker.py, which injects a failing forward).

Fault tests end with `assert_healthy_and_no_leak(cluster)`: a normal request is served, then at idle every KV
block is free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"      # the served name of the default model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load_report_async(address: str):
    """The scheduler's Engine.GetLoadReport, through the project's own gRPC client."""
    from steploop.client import EngineClient

    engine = EngineClient(address)
    try:
        return await engine.load_report()
    finally:
        await engine.close()


class Cluster:
    def __init__(self, log_dir: pathlib.Path, scheduler_args=(), worker_args=(), gateway_args=(),
                 num_kv_blocks: int = 640, env: dict | None = None, prefixes: dict | None = None,
                 modules: dict | None = None):
        self.log_dir = log_dir
        self.http_port, self.grpc_port = free_port(), free_port()
        self.scheduler_address = f"127.0.0.1:{self.grpc_port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.argv = {
            "scheduler": ["--scheduler-port", str(self.grpc_port), *scheduler_args],
            "worker": ["--scheduler-address", self.scheduler_address, "--num-kv-blocks", str(num_kv_blocks),
                       *worker_args],
            "gateway": ["--port", str(self.http_port), "--scheduler-address", self.scheduler_address,
                        *gateway_args],
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.prefixes = prefixes or {}          # service -> argv prefix (e.g. `ip netns exec NAME`)
        self.modules = modules or {}            # service -> module run instead of steploop.<name>

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start_service(self, name: str) -> subprocess.Popen:
        module = self.modules.get(name) or "steploop." + {"worker": "gpu_worker"}.get(name, name)
        log = open(self.log_dir / f"{name}.log", "ab")
        argv = [*self.prefixes.get(name, []), sys.executable, "-m", module, *self.argv[name]]
        proc = subprocess.Popen(argv, cwd=ROOT,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 600.0) -> "Cluster":
        for name in ("scheduler", "worker", "gateway"):
            self.start_service(name)
        self.wait_ready(timeout)
        return self

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 600.0) -> None:
        self._wait(lambda: self.health() == 200, timeout, "cluster not ready")

    def wait_replicas_up(self, addresses: list[str], timeout: float = 600.0) -> None:
        """Until this gateway routes to every replica in `addresses` (its /metrics says steploop:replica_up 1): the
        gateway is ready as soon as one replica is, and on a loaded machine another's worker may attach a minute
        later."""
        def all_up() -> bool:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as resp:
                text = resp.read().decode()
            return all(f'steploop:replica_up{{replica="{address}"}} 1.0' in text for address in addresses)
        self._wait(all_up, timeout, f"the gateway does not route to all of {addresses}")

    def _wait(self, condition, timeout: float, what: str) -> None:
        """Polls `condition` until it holds; a service of this cluster that exits, or the timeout, raises."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            time.sleep(0.25)    # a poll interval
        raise TimeoutError(f"{what} after {timeout} s:\n{self.logs()}")

    def stop_service(self, name: str, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop(self) -> None:
        for name in ("gateway", "scheduler", "worker"):
            if name in self.procs:
                self.stop_service(name, timeout=15)

    def logs(self, tail: int = 4000) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def load_report(self):
        return asyncio.run(load_report_async(self.scheduler_address))

    def wait_idle(self, timeout: float = 30.0):
        """Polls the load report until nothing runs or waits and every KV block is free (blocks are freed by the
        step loop, after the reply went out). Block 0 is the reserved null block, never free: all free is
        num_free_blocks == num_total_blocks - 1. Returns the last report, whole or not."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.load_report()
            if is_idle_and_whole(load) or time.monotonic() > deadline:
                return load
            time.sleep(0.2)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")


@contextlib.contextmanager
def two_replicas(tmp_path_factory, name: str, **cluster_kwargs):
    """Cluster A (scheduler, worker, gateway) plus replica B's scheduler and worker; A's gateway knows both."""
    a = Cluster(tmp_path_factory.mktemp(f"{name}-a"), **cluster_kwargs)
    b = Cluster(tmp_path_factory.mktemp(f"{name}-b"), **cluster_kwargs)
    b.http_port = free_port()
    a.argv["gateway"][a.argv["gateway"].index("--scheduler-address") + 1] = f"{a.scheduler_address},{b.scheduler_address}"
    try:
        for service in ("scheduler", "worker"):
            b.start_service(service)
        a.start()
        a.wait_replicas_up([a.scheduler_address, b.scheduler_address])
        yield a, b
    finally:
        a.stop()
        b.stop()


def is_idle_and_whole(load) -> bool:
    return (load.num_total_blocks > 0 and load.num_running == load.num_waiting == 0
            and load.num_free_blocks == load.num_total_blocks - 1)


def assert_healthy_and_no_leak(cluster: Cluster, prompt: str = "Hello", max_tokens: int = 6,
                               expect_text: str | None = None, timeout: float = 30.0, model: str = MODEL) -> dict:
    """How every fault test ends: a normal greedy request is served (with `expect_text`, that exact text), then at
    idle no request is left and every KV block is free. Returns the completion body."""
    status, body = cluster.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1, body
    if expect_text is not None:
        assert body["choices"][0]["text"] == expect_text, body
    load = cluster.wait_idle(timeout)
    assert is_idle_and_whole(load), f"not idle with every KV block free {timeout} s after the last reply: {load}"
    return body
