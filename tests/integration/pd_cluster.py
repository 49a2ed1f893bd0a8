"""A P/D cluster for integration tests: one scheduler, a decode worker (--kv-role decode, a host tier the received
blocks land in), a prefill worker (--kv-role prefill) and a gateway; and the checks its tests share."""

from __future__ import annotations

import time
import urllib.request

from tests.integration.cluster import Cluster, assert_healthy_and_no_leak
from tests.observability.scrape import parse, value_or_zero

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Chapter {i}. The old harbour town woke slowly: fishermen mended their nets, the baker opened his "
           f"shutters, and the {w} walked down to the pier to watch the boats come in, as every morning."
           for i, w in enumerate(["teacher", "doctor", "mayor", "painter"])]      # ~45 tokens: 2+ full blocks
LONG = [p * 7 for p in PROMPTS[:3]]     # ~300 tokens: prefills that take a while on the CPU


def pd_cluster(tmp_path, env: dict | None = None, lora: list[str] = (), scheduler_host: str | None = None,
               prefill_prefix: list[str] = (), kv_transfer: tuple[str, int] | None = None,
               transfer_timeout: float = 20, policy: str = "cost") -> Cluster:
    """lora: the adapter flags, for the scheduler, both workers and the gateway (a LoRA request's prompt may run on
    the prefill group, which loads the adapter as the decode group does). scheduler_host: the address the scheduler binds and every service
    dials (one the prefill worker reaches from its namespace); prefill_prefix: the prefill worker's argv prefix
    (`ip netns exec NAME`); kv_transfer: the decode worker's receiver (host, port); policy: --disagg-policy (a test
    that needs a prompt to cross forces it with the request's `disaggregation` field)."""
    host_args = ["--scheduler-host", scheduler_host] if scheduler_host else []
    kv_args = ["--kv-transfer-host", kv_transfer[0], "--kv-transfer-port", str(kv_transfer[1])] if kv_transfer else []
    cluster = Cluster(tmp_path, scheduler_args=["--disagg-policy", policy, "--disagg-min-prompt-tokens", "32",
                                                      *host_args, *lora], env=env,
                      num_kv_blocks=160, worker_args=["--kv-role", "decode", "--kv-offloading-size", "0.02",
                                                     "--max-model-len", "512", *kv_args, *lora],
                      gateway_args=lora[:1], modules={"prefill": "steploop.gpu_worker"},
                      prefixes={"prefill": list(prefill_prefix)})
    if scheduler_host:
        cluster.scheduler_address = f"{scheduler_host}:{cluster.grpc_port}"
        cluster.argv["worker"][1] = cluster.argv["gateway"][3] = cluster.scheduler_address
    cluster.argv["prefill"] = ["--scheduler-address", cluster.scheduler_address, "--num-kv-blocks", "64",
                               "--max-model-len", "512", "--kv-role", "prefill", "--kv-transfer-timeout",
                               str(transfer_timeout), *lora]
    try:
        cluster.start_service("prefill")
        cluster.start()
        cluster._wait(lambda: metric(cluster, "steploop:pd_prefill_group_up") == 1.0, 600, "no prefill group")
    except BaseException:
        stop(cluster)                         # a start that failed leaves no process behind
        raise
    return cluster


def stop(cluster: Cluster) -> None:
    cluster.stop()
    if "prefill" in cluster.procs:
        cluster.stop_service("prefill", timeout=15)


def metric(cluster: Cluster, name: str) -> float:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=30) as resp:
        return value_or_zero(parse(resp.read().decode()), name)


def complete(cluster: Cluster, prompt: str, max_tokens: int = 8, **extra) -> list[str]:
    status, body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, **extra})
    assert status == 200, body
    return [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def assert_both_pools_whole(cluster: Cluster, model: str = MODEL) -> None:
    assert_healthy_and_no_leak(cluster, "Hello", 4, timeout=60, model=model)
    deadline = time.monotonic() + 60
    while metric(cluster, "steploop:pd_prefill_free_blocks") != metric(cluster, "steploop:pd_prefill_total_blocks"):
        assert time.monotonic() < deadline, "prefill pool not whole at idle"
        time.sleep(0.2)                      # a poll interval
