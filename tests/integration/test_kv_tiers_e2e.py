"""KV tiers on a real cluster (scheduler, worker with --kv-offloading-size and a disk tier, gateway): a long prompt's
blocks leave a small pool for host memory and disk while other prompts run, and come back for its return; the
worker is SIGKILLed and restarted and the prompt comes back from its disk files; a flipped byte in every file is a
checksum miss in the worker's log. The text is transformers' greedy text every time."""

from __future__ import annotations

import signal
import time
import urllib.request

import pytest

from tests.integration.cluster import Cluster, assert_healthy_and_no_leak
from tests.observability.scrape import parse, value_or_zero

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LONG = ("The lighthouse keeper wrote in his log every night: the wind, the tide, the ships that passed, the gulls "
        "that nested on the rocks below, the storms that rolled in from the west, and the letters he never sent. ") * 4
FILLERS = [f"Story number {i}: once upon a time in a land far away there lived a {w} who loved to travel across "
           f"the mountains and rivers, meeting strangers, trading stories, learning songs and recipes, and "
           f"writing everything down in a small leather notebook that never left the pocket of the {w}. "
           * 3 for i, w in enumerate(["baker", "sailor", "painter", "farmer"])]   # ~220 and ~180 tokens: one
# of each do not fit the 19-block pool together


def tier_hits(cluster: Cluster, medium: str) -> float:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as resp:
        return value_or_zero(parse(resp.read().decode()), "steploop:kv_tier_hits_total", medium=medium)


def complete(cluster: Cluster, prompt: str, max_tokens: int = 8) -> str:
    status, body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def restart_worker(cluster: Cluster, tmp_path) -> None:
    log = tmp_path / "scheduler.log"
    attached = log.read_text().count("attached:")
    cluster.stop_service("worker", sig=signal.SIGKILL)
    cluster.start_service("worker")
    deadline = time.monotonic() + 300
    while log.read_text().count("attached:") <= attached:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)                  # a poll interval


def test_tiers_restore_from_host_and_from_disk_after_a_restart(tmp_path, model_dir, hf):
    disk = tmp_path / "kv_disk"
    cluster = Cluster(tmp_path, num_kv_blocks=20, worker_args=[
        "--max-model-len", "304", "--kv-offloading-size", "0.01", "--kv-disk-path", str(disk),
        "--kv-disk-size", "0.05"]).start()
    try:
        want = hf.greedy_text(hf.text_ids(LONG), 8)
        assert complete(cluster, LONG) == want
        for filler in FILLERS:               # LONG's blocks leave the pool, then host memory
            complete(cluster, filler, 2)
        assert complete(cluster, LONG) == want
        assert tier_hits(cluster, "CPU") > 0, "the returning prompt was not restored"
        assert list(disk.rglob("*.kvb")), "nothing reached the disk"
        for filler in FILLERS:
            complete(cluster, filler, 2)

        restart_worker(cluster, tmp_path)
        disk_hits = tier_hits(cluster, "DISK")
        assert complete(cluster, LONG) == want
        assert tier_hits(cluster, "DISK") > disk_hits, "the restarted worker's disk files were not used"

        for f in disk.rglob("*.kvb"):        # one flipped payload byte per file
            data = bytearray(f.read_bytes())
            data[-7] ^= 0x10
            f.write_bytes(bytes(data))
        restart_worker(cluster, tmp_path)
        assert complete(cluster, LONG) == want
        assert "checksum mismatch" in (tmp_path / "worker.log").read_text()
        assert_healthy_and_no_leak(cluster, LONG, 8, expect_text=want)
    finally:
        cluster.stop()
