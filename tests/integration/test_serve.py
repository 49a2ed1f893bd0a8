"""`steploop serve`: one command starts the three services, restarts one that dies, stops all on SIGTERM (its
signals, Ctrl-C included: test_serve_signals.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.cluster import ROOT, free_port
from tests.integration.serve_process import ServeProcess

pytestmark = pytest.mark.slow


def test_serve_starts_restarts_and_stops(tmp_path):
    serve = ServeProcess(tmp_path, "--num-kv-blocks", "600")
    try:
        serve.wait_ready(600)
        status, body = serve.cluster.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                              "max_tokens": 3})
        assert status == 200, body
        # the supervisor logs "ready in" when its own /health poll succeeds, which may be just after ours
        serve.wait_for_log("ready in", 30)
        assert "loading" in serve.log().lower()                       # the model load is shown
        os.kill(serve.pids("worker")[-1], signal.SIGKILL)             # a service dies...
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(serve.pids("worker")) < 2:
            time.sleep(0.5)
        assert len(serve.pids("worker")) == 2, serve.log()[-3000:]
        serve.wait_ready(600)                                         # ...and is back, serving
        status, body = serve.cluster.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                              "max_tokens": 3})
        assert status == 200, body
        serve.proc.send_signal(signal.SIGTERM)
        serve.wait_all_gone(90)
    finally:
        serve.kill()
    assert serve.proc.returncode == 0, serve.log()[-3000:]


def test_serve_refuses_a_bad_flag_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "steploop.cli", "serve", "--max-num-seqs", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "--max-num-seqs" in out.stderr and "Traceback" not in out.stderr
    assert "started" not in out.stderr


def test_serve_stops_instead_of_restarting_a_service_with_an_impossible_config(tmp_path):
    """Too few KV blocks for one full-length sequence is known only once the worker loads: it exits 2 with the
    fix in its message, and the supervisor stops the cluster instead of restarting it in a loop."""
    out = subprocess.run([sys.executable, "-m", "steploop.cli", "serve", "--num-kv-blocks", "3", "--port",
                          str(free_port()), "--scheduler-port", str(free_port()), "--metrics-port", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)   # the worker loads first: minutes when loaded
    assert out.returncode == 1
    assert "raise --num-kv-blocks or lower --max-model-len" in out.stderr
    assert out.stderr.count("started worker") == 1
