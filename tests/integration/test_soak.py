"""A bounded soak: many concurrent streams with random aborts, slow readers and preemption pressure (a small KV
pool). Every request ends (finished or aborted by its client), memory stays bounded, and at idle every KV block is
free again. A longer run of the same scenario is `python -m benchmarks.soak`."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.cluster import Cluster
from tests.integration.soak import SoakSettings, run_soak

pytestmark = pytest.mark.slow


def test_soak_nothing_lost_nothing_leaked(tmp_path, model_dir):
    # 24 blocks x 16 tokens for 16 streams of ~20-120 tokens each: preemption is certain.
    cluster = Cluster(tmp_path, worker_args=["--max-model-len", "256"], num_kv_blocks=24,
                      scheduler_args=["--max-num-seqs", "16"])
    try:
        cluster.start()
        report = asyncio.run(run_soak(cluster, SoakSettings(duration_s=30, concurrency=16, abort_probability=0.4, seed=1)))
    finally:
        cluster.stop()
    assert report.started >= 16, report
    assert report.completed + report.aborted_by_client == report.started, report
    assert report.errors == [], report
    assert report.completed >= 8 and report.aborted_by_client >= 1, report
    assert report.free_blocks_at_idle == report.total_blocks - 1, report
    assert report.rss_growth_mb["scheduler"] < 100 and report.rss_growth_mb["gateway"] < 150, report
    assert "; it will be recomputed" in (tmp_path / "scheduler.log").read_text()   # real preemption pressure
