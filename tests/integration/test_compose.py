"""docker-compose.yml starts the same cluster as local processes.

No Docker engine runs in CI, so this test reads the compose file and runs each default-profile service's
command with its environment (compose's ${VAR:-default} interpolation applied) as a local process: service
host names resolved to loopback, ports moved to free ones, the secrets made by deploy/make-certs.sh, the model
volume the converted default model. Then it asks the gateway for a completion, with the API key, over mutual
TLS between the services. A compose file whose commands, variables or TLS settings don't start a working
cluster fails. deploy/smoke.sh runs the real containers where an engine is available.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.integration.cluster import ROOT, Cluster, free_port

pytestmark = pytest.mark.slow
ONE_SHOT = {"model"}     # copies the default model into the volume: here the local converted model is the volume


def default_services(compose: dict) -> dict:
    profiles = {"cpu"}   # .env: COMPOSE_PROFILES=cpu
    return {name: svc for name, svc in compose["services"].items()
            if not svc.get("profiles") or profiles & set(svc["profiles"])}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} and ${VAR:?error}."""
    def one(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        if op == ":?":
            assert env.get(name), f"compose needs {name}: {arg}"
            return env[name]
        if op == ":-":
            return env.get(name) or arg
        if op == "-":
            return env.get(name, arg)
        return env.get(name, "")
    return re.sub(r"\$\{(\w+)(?:(:\?|:-|-)([^}]*))?\}", one, value)


def test_env_file_selects_cpu_profile():
    assert "COMPOSE_PROFILES=cpu" in (ROOT / ".env").read_text()


def test_compose_services_start_a_working_cluster(tmp_path, model_dir):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = default_services(compose)
    assert set(services) == {"scheduler", "worker", "gateway"} | ONE_SHOT
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(certs)], check=True, capture_output=True)
    api_key = (certs / "api-key").read_text().strip()
    http, grpc_port = free_port(), free_port()
    rename = {"scheduler:50051": f"127.0.0.1:{grpc_port}", "50051": str(grpc_port), "8000": str(http),
              "0.0.0.0": "127.0.0.1", "/models/SmolLM2-135M-Instruct": str(model_dir)}
    compose_env = {"STEPLOOP_API_KEY": api_key}
    procs, envs = [], {}
    try:
        for name in ("scheduler", "worker", "gateway"):
            svc = services[name]
            values = {k: interpolate(str(v), compose_env) for k, v in svc["environment"].items()}
            values = {k: rename.get(v, v).replace("/run/secrets/", f"{certs}/") for k, v in values.items()}
            assert name == "gateway" or "STEPLOOP_API_KEY" not in values
            env = {**os.environ, **values, "STEPLOOP_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
            if name == "worker":
                env["STEPLOOP_NUM_KV_BLOCKS"] = "600"        # keep the test's memory small
            envs[name] = env
            command = svc.get("command", ["steploop", name])
            assert command[0] == "steploop"
            log = open(tmp_path / f"{name}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "steploop.cli", *command[1:]], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
        cluster = Cluster(tmp_path)
        cluster.http_port = http
        cluster.procs = dict(zip(("scheduler", "worker", "gateway"), procs))
        cluster.wait_ready(600)   # the worker loads and packs its weights first: minutes on a loaded 2-core host
        probes = {"scheduler": ["grpc"], "scheduler-alive": ["grpc", "--alive"], "gateway": ["http"],
                  "worker": ["grpc", "--target", f"127.0.0.1:{grpc_port}"]}
        for probe, args in probes.items():   # the images' HEALTHCHECK, with each service's own TLS settings
            env = {**os.environ, **{k: v for k, v in envs[probe.split("-")[0]].items() if k.startswith("STEPLOOP_")}}
            check = subprocess.run([sys.executable, str(ROOT / "deploy/docker/healthcheck.py"), *args], env=env,
                                   capture_output=True, text=True, timeout=30, check=False)
            assert check.returncode == 0, (probe, check.stderr)
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4}
        status, _ = cluster.post("/v1/completions", body)
        assert status == 401                                   # the key is required
        status, reply = cluster.post("/v1/completions", body, headers={"Authorization": f"Bearer {api_key}"})
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
