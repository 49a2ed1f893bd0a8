"""Prefill/decode disaggregation on a real cluster: one scheduler, a decode worker (--kv-role decode, host tier for
received blocks), a prefill worker (--kv-role prefill), a gateway. Greedy text equals transformers' for plain,
streamed and n=2 requests whose prompts ran on the prefill group and whose KV moved over TCP; a block corrupted in
flight (the test hook) is refused by its checksum and recomputed on the decode group (counted); a SIGKILLed
prefill worker leaves its requests to complete locally. Every case ends with no KV block held on either side."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from tests.integration.api_helpers import client
from tests.integration.cluster import Cluster, assert_healthy_and_no_leak
from tests.observability.scrape import parse, value_or_zero

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Chapter {i}. The old harbour town woke slowly: fishermen mended their nets, the baker opened his "
           f"shutters, and the {w} walked down to the pier to watch the boats come in, as every morning."
           for i, w in enumerate(["teacher", "doctor", "mayor", "painter"])]      # ~45 tokens: 2+ full blocks
LONG = [p * 7 for p in PROMPTS[:3]]     # ~300 tokens: prefills that take a while on the CPU


def pd_cluster(tmp_path, env: dict | None = None) -> Cluster:
    cluster = Cluster(tmp_path, scheduler_args=["--disagg-min-prompt-tokens", "32"], env=env,
                      num_kv_blocks=160, worker_args=["--kv-role", "decode", "--kv-offloading-size", "0.02",
                                                     "--max-model-len", "512"],
                      modules={"prefill": "steploop.gpu_worker"})
    cluster.argv["prefill"] = ["--scheduler-address", cluster.scheduler_address, "--num-kv-blocks", "64",
                               "--max-model-len", "512", "--kv-role", "prefill", "--kv-transfer-timeout", "20"]
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


def assert_both_pools_whole(cluster: Cluster) -> None:
    assert_healthy_and_no_leak(cluster, "Hello", 4, timeout=60)
    deadline = time.monotonic() + 60
    while metric(cluster, "steploop:pd_prefill_free_blocks") != metric(cluster, "steploop:pd_prefill_total_blocks"):
        assert time.monotonic() < deadline, "prefill pool not whole at idle"
        time.sleep(0.2)                      # a poll interval


def test_disaggregated_requests_match_one_group(tmp_path, model_dir, hf):
    cluster = pd_cluster(tmp_path)
    try:
        want = [hf.greedy_text(hf.text_ids(p), 8) for p in PROMPTS]
        assert complete(cluster, PROMPTS[0]) == [want[0]]
        assert metric(cluster, "steploop:pd_kv_transfers_total") >= 1, "the prompt did not go through the prefill group"
        assert complete(cluster, PROMPTS[1], n=2) == [want[1], want[1]]
        stream = client(cluster).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                                    stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == want[2]
        assert complete(cluster, PROMPTS[3], disaggregation="local") == [want[3]]
        results: dict[int, list[str]] = {}          # concurrent: prefills and decodes overlap
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(cluster, PROMPTS[i])))
                   for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [results[i] for i in range(len(PROMPTS))] == [[w] for w in want]
        assert metric(cluster, "steploop:pd_fallbacks_total") == 0
        assert metric(cluster, "steploop:pd_kv_transfer_bytes_total") > 0
        assert_both_pools_whole(cluster)

        # SIGKILL the prefill worker while prompts are on it: every request completes, via local prefill.
        results.clear()
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(cluster, LONG[i], 8)))
                   for i in range(len(LONG))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while metric(cluster, "steploop:pd_prefill_requests") < 2:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.02)                 # a poll interval
        cluster.stop_service("prefill", sig=signal.SIGKILL)
        for t in threads:
            t.join(300)
        assert [results[i] for i in range(len(LONG))] == [[hf.greedy_text(hf.text_ids(p), 8)] for p in LONG]
        assert metric(cluster, "steploop:pd_fallbacks_total") >= 1
        assert complete(cluster, PROMPTS[0]) == [want[0]]    # the prefill group is down: local
        assert metric(cluster, "steploop:pd_prefill_group_up") == 0
        assert_healthy_and_no_leak(cluster, "Hello", 4, timeout=60)
    finally:
        stop(cluster)


def test_corrupted_block_is_recomputed_and_counted(tmp_path, model_dir, hf):
    cluster = pd_cluster(tmp_path, env={"STEPLOOP_TEST_CORRUPT_KV_TRANSFER": "1"})
    try:
        for prompt in PROMPTS[:2]:
            assert complete(cluster, prompt) == [hf.greedy_text(hf.text_ids(prompt), 8)]
        assert metric(cluster, "steploop:pd_fallbacks_total") >= 2
        assert metric(cluster, "steploop:pd_kv_transfer_failures_total") >= 2
        assert metric(cluster, "steploop:pd_kv_transfers_total") == 0
        assert "checksum mismatch" in (tmp_path / "worker.log").read_text()
        assert_both_pools_whole(cluster)
    finally:
        stop(cluster)
