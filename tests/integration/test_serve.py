"""`steploop serve`: one command starts the three services, restarts one that dies, stops all on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.cluster import ROOT, Cluster, free_port

pytestmark = pytest.mark.slow


def _pids(log_text: str, name: str) -> list[int]:
    return [int(p) for p in re.findall(rf"started {name} \(pid (\d+)\)", log_text)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_starts_restarts_and_stops(tmp_path):
    http, grpc_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "services.cli", "serve", "--port", str(http), "--scheduler-port",
            str(grpc_port), "--num-kv-blocks", "600"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    cluster = Cluster(tmp_path)
    cluster.http_port = http
    cluster.procs = {"serve": proc}
    try:
        cluster.wait_ready(240)
        status, body = cluster.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                        "max_tokens": 3})
        assert status == 200, body
        # the supervisor logs "ready in" when its own /health poll succeeds, which may be just after ours
        deadline = time.monotonic() + 30
        while "ready in" not in (text := log_path.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "ready in" in text and "loading" in text.lower()       # the model load is shown
        worker_pid = _pids(text, "worker")[-1]
        os.kill(worker_pid, signal.SIGKILL)                            # a service dies...
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_pids(log_path.read_text(), "worker")) < 2:
            time.sleep(0.5)
        assert len(_pids(log_path.read_text(), "worker")) == 2, log_path.read_text()[-3000:]
        cluster.wait_ready(180)                                        # ...and is back, serving
        status, body = cluster.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                        "max_tokens": 3})
        assert status == 200, body
        children = [p for name in ("scheduler", "worker", "gateway") for p in _pids(log_path.read_text(), name)]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    assert code == 0, log_path.read_text()[-3000:]
    assert not any(_alive(p) for p in children)


def test_serve_refuses_a_bad_flag_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--max-num-seqs", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--max-num-seqs" in out.stderr and "Traceback" not in out.stderr
    assert "started" not in out.stderr


def test_serve_stops_instead_of_restarting_a_service_with_an_impossible_config(tmp_path):
    """Too few KV blocks for one full-length sequence is known only once the worker loads: it exits 2 with the
    fix in its message, and the supervisor stops the cluster instead of restarting it in a loop."""
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--num-kv-blocks", "3", "--port",
                          str(free_port()), "--scheduler-port", str(free_port())], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert "raise --num-kv-blocks or lower --max-model-len" in out.stderr
    assert out.stderr.count("started worker") == 1
