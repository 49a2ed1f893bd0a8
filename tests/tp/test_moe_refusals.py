"""--enable-expert-parallel where it cannot place experts is refused with exit code 2 and the reason, before any
weight loads: without ranks (-tp 1), and on a model without mixture-of-experts layers (worker and serve)."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.cluster import ROOT, free_port


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)


def test_worker_expert_parallel_without_ranks_exits_2():
    out = run("steploop.gpu_worker", "--enable-expert-parallel")
    assert out.returncode == 2 and "--enable-expert-parallel needs -tp 2 or more" in out.stderr, out.stderr


def test_worker_expert_parallel_on_a_dense_model_exits_2_before_loading(model_dir):
    out = run("steploop.gpu_worker", "-tp", "3", "--rank", "1", "--enable-expert-parallel",
              "--scheduler-address", f"127.0.0.1:{free_port()}")
    assert out.returncode == 2, out.stderr
    assert "--enable-expert-parallel: llama has no mixture-of-experts layers" in out.stderr, out.stderr
    assert "loading weights" not in out.stderr, out.stderr


def test_serve_expert_parallel_on_a_dense_model_exits_2_before_starting(model_dir):
    out = run("steploop.cli", "serve", "-tp", "3", "--enable-expert-parallel", "--port", str(free_port()),
              "--scheduler-port", str(free_port()), "--metrics-port", "0")
    assert out.returncode == 2, out.stderr
    assert "no mixture-of-experts layers" in out.stderr and "loading" not in out.stderr, out.stderr
