"""docker-compose.yml and every override in deploy/compose/, as `docker compose config` resolves them (Compose v2
reads and validates the files; no engine needed): each file alone over docker-compose.yml, each combined with
host-network.yml, and each X.yml with its host-network form X-host-network.yml. Under host networking every
service that starts is on the host's network (a service left on the default network makes compose create a
bridge, which a daemon with "bridge": "none" cannot), dials and listens on loopback, and no two schedulers share a
port. Compose v2 is installed by `make compose-tools` (a prerequisite of `make test`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.deploy.k8s_render import ROOT

COMPOSE = ROOT / "deploy" / "compose"
HOST = "host-network.yml"
OVERRIDES = sorted(p.name for p in COMPOSE.glob("*.yml") if p.name != HOST and not p.stem.endswith("-host-network"))
NEEDS = {"kv-pull.yml": ["replicas.yml"]}    # an override that is layered after others (its header says so)
REGISTRY = "registry.example.com/steploop"
pytestmark = pytest.mark.slow   # ~40 s of `docker compose config` runs: `make test` runs them, `make test-fast` not


def docker_compose() -> list[str]:
    docker = shutil.which("docker")
    version = subprocess.run([docker, "compose", "version", "--short"], capture_output=True, text=True,
                             check=False) if docker else None
    if version is None or version.returncode != 0 or not version.stdout.startswith(("2.", "v2.")):
        raise RuntimeError("these tests need Docker Compose v2 (`docker compose`): run `make compose-tools` "
                           "(deploy/compose/install-compose-v2.sh)")
    return [docker, "compose"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(folder)], check=True, capture_output=True)
    return folder


def config(certs, files: list[str], profiles: str = "cpu", **env: str) -> dict:
    args = [arg for name in ["docker-compose.yml", *(f"deploy/compose/{f}" for f in files)] for arg in ("-f", name)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLOOP_", "COMPOSE_"))}
    environ.update(STEPLOOP_API_KEY="k", STEPLOOP_CERTS=str(certs), COMPOSE_PROFILES=profiles, **env)
    out = subprocess.run([*docker_compose(), *args, "config", "--format", "json"], cwd=ROOT, env=environ,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, f"docker compose {' '.join(args)} config failed:\n{out.stderr}"
    return json.loads(out.stdout)


def layered(name: str) -> list[str]:
    """name with the overrides it is layered after"""
    return [*NEEDS.get(name, []), name]


def host_form(name: str) -> list[str]:
    """name's layering under host networking: host-network.yml, then each of layered(name) followed by its
    host-network form if it has one."""
    forms = [(f, f.replace(".yml", "-host-network.yml")) for f in layered(name)]
    return [HOST] + [p for f, extra in forms for p in [f] + ([extra] if (COMPOSE / extra).is_file() else [])]


def test_every_file_is_covered():
    assert {"pd.yml", "replicas.yml", "tp.yml"} <= set(OVERRIDES), OVERRIDES
    for path in COMPOSE.glob("*-host-network.yml"):
        assert path.name.replace("-host-network", "") in OVERRIDES, f"{path.name} forms no override's host form"


@pytest.mark.parametrize("files", [[]] + [layered(name) for name in OVERRIDES] + [[HOST]] +
                         [[HOST, *layered(name)] for name in OVERRIDES], ids=str)
@pytest.mark.parametrize("profiles", ["cpu", "gpu"])
def test_validates(certs, files, profiles):
    services = config(certs, files, profiles)["services"]
    assert {"model", "scheduler", "gateway"} <= set(services), files


@pytest.mark.parametrize("files", [[HOST]] + [host_form(name) for name in OVERRIDES], ids=str)
@pytest.mark.parametrize("profiles", ["cpu", "gpu"])
def test_host_networking_covers_every_service(certs, files, profiles):
    resolved = config(certs, files, profiles)
    services = resolved["services"]
    assert not resolved.get("networks"), f"{files}: compose would create networks {list(resolved['networks'])}"
    ports = []
    for name, svc in services.items():
        assert svc.get("network_mode") == "host", f"{files}: {name} is not on the host network"
        assert svc["build"].get("network") == "host", f"{files}: {name} builds on the default network"
        env = svc.get("environment") or {}
        for address in filter(None, env.get("STEPLOOP_SCHEDULER_ADDRESS", "").split(",")):
            assert address.startswith("127.0.0.1:"), (files, name, address)
        for key in ("STEPLOOP_HOST", "STEPLOOP_SCHEDULER_HOST", "STEPLOOP_TP_HOST", "STEPLOOP_KV_TRANSFER_HOST"):
            assert env.get(key, "127.0.0.1") == "127.0.0.1", (files, name, key, env[key])
        if "STEPLOOP_SCHEDULER_PORT" in env:
            ports.append(env["STEPLOOP_SCHEDULER_PORT"])
    assert len(ports) == len(set(ports)), f"{files}: schedulers share a port: {ports}"
    gateway = services["gateway"]["environment"]["STEPLOOP_SCHEDULER_ADDRESS"].split(",")
    assert sorted(a.rpartition(":")[2] for a in gateway) == sorted(ports), (files, gateway, ports)


def test_tp_replaces_the_single_worker(certs):
    for files in (["tp.yml"], host_form("tp.yml")):
        services = config(certs, files)["services"]
        assert "worker" not in services and {"worker-0", "worker-1", "worker-2"} <= set(services), files


@pytest.mark.parametrize("files", [[]] + [host_form(name) for name in OVERRIDES], ids=str)
def test_the_registry_names_every_image(certs, files):
    """STEPLOOP_REGISTRY, the Makefile's variable, names every image compose runs (and builds)."""
    for profiles in ("cpu", "gpu"):
        for name, svc in config(certs, files, profiles, STEPLOOP_REGISTRY=REGISTRY)["services"].items():
            assert svc["image"].startswith(REGISTRY + "/"), (files, name, svc["image"])


def test_long_running_services_restart_after_a_crash(certs):
    """unless-stopped: Docker restarts a service whose process died (a crash, the OOM killer, a SIGKILL from the
    host) and one that was up when the daemon restarted; `docker stop`/`docker kill` are an operator's stop,
    which no policy overrides (deploy/compose/README.md)."""
    for name, svc in config(certs, host_form("replicas.yml"))["services"].items():
        assert svc["restart"] == ("no" if name == "model" else "unless-stopped"), name


@pytest.mark.parametrize("host_network", [False, True], ids=["bridge", "host-network"])
@pytest.mark.parametrize("profiles", ["cpu", "gpu"])
def test_pd_runs_one_decode_and_one_prefill_worker(certs, profiles, host_network):
    """pd.yml: the profile's worker decodes (a host KV tier for the blocks it receives, its receiver on an address
    the prefill worker can reach), one prefill worker dials the same scheduler, the scheduler is told the rule."""
    files = host_form("pd.yml") if host_network else ["pd.yml"]
    services = config(certs, files, profiles)["services"]
    roles = {name: svc["environment"].get("STEPLOOP_KV_ROLE") for name, svc in services.items()
             if "STEPLOOP_KV_ROLE" in (svc.get("environment") or {})}
    decode_name = "worker" if profiles == "cpu" else "worker-gpu"
    assert roles == {decode_name: "decode", "prefill" if profiles == "cpu" else "prefill-gpu": "prefill"}, roles
    decode = services[decode_name]["environment"]
    assert float(decode["STEPLOOP_KV_OFFLOADING_SIZE"]) > 0 and int(decode["STEPLOOP_KV_TRANSFER_PORT"]) > 0
    assert decode["STEPLOOP_KV_TRANSFER_HOST"] == ("127.0.0.1" if host_network else decode_name)
    prefill = next(services[n]["environment"] for n, role in roles.items() if role == "prefill")
    assert prefill["STEPLOOP_SCHEDULER_ADDRESS"] == decode["STEPLOOP_SCHEDULER_ADDRESS"]
    assert int(services["scheduler"]["environment"]["STEPLOOP_DISAGG_MIN_PROMPT_TOKENS"]) >= 0
    if profiles == "gpu":   # two GPUs: the prefill worker does not share the decode worker's
        (device,) = services["prefill-gpu"]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["1"] and "count" not in device


@pytest.mark.parametrize("host_network", [False, True], ids=["bridge", "host-network"])
def test_kv_pull_makes_both_replicas_send_and_receive(certs, host_network):
    """kv-pull.yml over replicas.yml: both workers send and receive (a host tier, each receiver on an address the
    other replica's worker reaches, distinct ports on one host), both schedulers publish KV events, the gateway
    hints pulls."""
    services = config(certs, host_form("kv-pull.yml") if host_network else layered("kv-pull.yml"))["services"]
    workers = {name: services[name]["environment"] for name in ("worker", "worker-2")}
    for name, env in workers.items():
        assert env["STEPLOOP_KV_ROLE"] == "both" and float(env["STEPLOOP_KV_OFFLOADING_SIZE"]) > 0, name
        assert env["STEPLOOP_KV_TRANSFER_HOST"] == ("127.0.0.1" if host_network else name)
    assert len({env["STEPLOOP_KV_TRANSFER_PORT"] for env in workers.values()}) == 2
    for name in ("scheduler", "scheduler-2"):
        events = json.loads(services[name]["environment"]["STEPLOOP_KV_EVENTS_CONFIG"])
        assert events["enable_kv_cache_events"] is True, name
    gateway = services["gateway"]["environment"]
    assert gateway["STEPLOOP_ENABLE_KV_PULL"] == "true" and float(gateway["STEPLOOP_KV_PULL_BANDWIDTH"]) > 0
    assert len(gateway["STEPLOOP_SCHEDULER_ADDRESS"].split(",")) == 2


def flag_variables() -> dict[str, set[str]]:
    """command -> the STEPLOOP_* variable of every flag its parser takes (STEPLOOP_ + the long flag's name)."""
    from scripts.readme_flags import options, parsers
    from services.common.envs import env_name
    return {command: {env_name(flag) for action in options(parser) for flag in action.option_strings
                      if flag.startswith("--")} for command, parser in parsers().items()}


# the images' healthcheck reads the server name (deploy/docker/healthcheck.py); the cache folder (README)
NON_FLAG_VARIABLES = {"STEPLOOP_TLS_SERVER_NAME", "STEPLOOP_CACHE_DIR"}


def test_every_variable_names_a_flag(certs):
    """Each STEPLOOP_* setting the overrides give a scheduler, worker or gateway is one its command reads (a
    misspelt name would be ignored silently); the rest of the STEPLOOP_* names are compose's own substitutions."""
    known = flag_variables()
    for files in [[]] + [host_form(name) for name in OVERRIDES]:
        for profiles in ("cpu", "gpu"):
            for name, svc in config(certs, files, profiles)["services"].items():
                command = "gateway" if name == "gateway" else "scheduler" if name.startswith("scheduler") else \
                    "worker" if name != "model" else None
                for variable in svc.get("environment") or {}:
                    if command and variable.startswith("STEPLOOP_") and variable not in NON_FLAG_VARIABLES:
                        assert variable in known[command], (files, name, variable)
