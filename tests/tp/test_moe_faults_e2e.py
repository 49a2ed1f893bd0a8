"""A rank of an expert-parallel group killed mid-stream (random Qwen2-MoE, -tp 2 --enable-expert-parallel, real
processes): half the experts go with it, the group breaks, every request is preempted and recomputed once the
restarted rank re-joins, and every stream ends with transformers' greedy text (tests/tp/test_tp_faults_e2e.py's
scenario, on the MoE layout)."""

from __future__ import annotations

import signal

import pytest

from tests.integration.hf_reference import HFReference
from tests.tp.test_tp_faults_e2e import _check, _fault_scenario, _reformed, _wait_for_log
from tests.tp.tp_cluster import TpCluster
from tests.worker.family_models import build_family_model

pytestmark = pytest.mark.slow


def test_killed_expert_parallel_rank_breaks_the_group_and_it_reforms(tmp_path, model_dir):
    path = build_family_model("qwen2_moe", tmp_path / "qwen2-moe", model_dir)
    cluster = TpCluster(tmp_path, 2, model=str(path), collective_timeout=4.0,
                        scheduler_args=["--hang-timeout", "60"], worker_args=["--enable-expert-parallel"]).start()
    try:
        def kill_and_restart():
            cluster.stop_service("worker-1", sig=signal.SIGKILL)
            _wait_for_log(cluster.log_dir / "scheduler.log", "detached")
            cluster.start_service("worker-1")

        _check(cluster, HFReference(path), path.name, _fault_scenario(cluster, path.name, kill_and_restart))
        assert _reformed(cluster.log_dir / "worker-0.log")
        assert "rank 1: experts 3-5" in (cluster.log_dir / "worker-1.log").read_text()
    finally:
        cluster.stop()
