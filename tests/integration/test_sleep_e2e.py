"""Sleep mode on the real cluster (default model, CPU worker): /sleep level 1 frees the KV cache, level 2 the
weights too; the worker's resident memory drops and comes back; requests meanwhile get 503 engine_paused
(--paused-request-timeout 0); after /wake_up the same greedy request gives the same tokens."""

from __future__ import annotations

import json

import pytest

from tests.integration.cluster import MODEL, Cluster

pytestmark = pytest.mark.slow

ADMIN = "admin-key"
REQUEST = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}


def test_sleep_frees_memory_and_wake_up_serves_the_same_tokens(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("sleep"), worker_args=["--device", "cpu"],
                      gateway_args=["--admin-api-key", ADMIN, "--paused-request-timeout", "0"],
                      num_kv_blocks=640).start()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        status, before = cluster.post("/v1/completions", REQUEST)
        assert status == 200
        figures = {}
        for level in (1, 2):
            status, awake = cluster.post("/pause?mode=wait", {}, admin)     # RSS while idle, before sleeping
            assert status == 200
            cluster.post("/resume", {}, admin)
            status, asleep = cluster.post(f"/sleep?level={level}", {}, admin)
            assert status == 200 and asleep["sleep_level"] == level, asleep
            status, body = cluster.post("/v1/completions", REQUEST)
            assert (status, body["error"]["code"]) == (503, "engine_paused")
            status, woke = cluster.post("/wake_up", {}, admin)
            assert status == 200 and woke["paused"] is False, woke
            status, after = cluster.post("/v1/completions", REQUEST)
            assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
            figures[level] = (asleep["worker_rss_bytes"][0], woke["worker_rss_bytes"][0])
        print("worker RSS MiB (asleep, awake):", json.dumps({k: [v >> 20 for v in vs] for k, vs in figures.items()}))
        kv_bytes = 640 * 16 * 30 * 2 * 3 * 64 * 4          # blocks x tokens x layers x K,V x heads x dim x fp32
        for level, (asleep, awake) in figures.items():
            assert awake - asleep > 0.8 * kv_bytes, (level, asleep, awake)
        assert figures[1][0] - figures[2][0] > 50 << 20     # level 2 also freed the weights
    finally:
        cluster.stop()
