"""-tp sizes the default model's shapes cannot split are refused with exit code 2 before any weight loads, and a
rank whose model / block size / dtype differs from the group's is refused by the scheduler, naming both values."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.cluster import ROOT, free_port

MESSAGE = "-tp 2: 9 attention heads do not divide by 2"


def test_worker_tp2_on_default_model_exits_2_before_loading(model_dir):
    out = subprocess.run([sys.executable, "-m", "steploop.gpu_worker", "-tp", "2", "--rank", "1",
                          "--scheduler-address", f"127.0.0.1:{free_port()}"], cwd=ROOT, capture_output=True, check=False,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert MESSAGE in out.stderr and "sizes that divide: 1, 3" in out.stderr, out.stderr
    assert "loading model" not in out.stderr and "loading weights" not in out.stderr, out.stderr


def test_serve_tp2_on_default_model_exits_2_before_starting(model_dir):
    out = subprocess.run([sys.executable, "-m", "steploop.cli", "serve", "-tp", "2", "--port", str(free_port()),
                          "--scheduler-port", str(free_port()), "--metrics-port", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert MESSAGE in out.stderr and "sizes that divide: 1, 3" in out.stderr, out.stderr
    assert "loading" not in out.stderr, out.stderr


def test_worker_rank_out_of_range_exits_2():
    out = subprocess.run([sys.executable, "-m", "steploop.gpu_worker", "-tp", "3", "--rank", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "--rank 3 must be in 0..2" in out.stderr, out.stderr
