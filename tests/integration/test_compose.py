"""docker-compose.yml starts the same cluster as local processes.

Docker cannot run here, so this test reads the compose file and runs each default-profile service's command with
its environment as a local process (service host names resolved to loopback, ports moved to free ones), then
asks the gateway for a completion. A compose file whose commands or variables don't start a working cluster fails.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.integration.cluster import ROOT, Cluster, free_port

pytestmark = pytest.mark.slow


def default_services(compose: dict) -> dict:
    profiles = {"cpu"}   # .env: COMPOSE_PROFILES=cpu
    return {name: svc for name, svc in compose["services"].items()
            if not svc.get("profiles") or profiles & set(svc["profiles"])}


def test_env_file_selects_cpu_profile():
    assert "COMPOSE_PROFILES=cpu" in (ROOT / ".env").read_text()


def test_compose_services_start_a_working_cluster(tmp_path):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = default_services(compose)
    assert set(services) == {"scheduler", "worker", "gateway"}
    http, grpc_port = free_port(), free_port()
    rename = {"scheduler:50051": f"127.0.0.1:{grpc_port}", "50051": str(grpc_port), "8000": str(http),
              "0.0.0.0": "127.0.0.1"}
    procs = []
    try:
        for name in ("scheduler", "worker", "gateway"):
            svc = services[name]
            env = {**os.environ, **{k: rename.get(str(v), str(v)) for k, v in svc["environment"].items()}}
            if name == "worker":
                env["STEPLOOP_NUM_KV_BLOCKS"] = "600"        # keep the test's memory small
            argv = [sys.executable, "-m", "services.cli", *svc["command"][1:]]
            assert svc["command"][0] == "steploop"
            log = open(tmp_path / f"{name}.log", "wb")
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        cluster = Cluster(tmp_path)
        cluster.http_port = http
        cluster.procs = dict(zip(("scheduler", "worker", "gateway"), procs))
        cluster.wait_ready(180)
        status, body = cluster.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                                                        "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
