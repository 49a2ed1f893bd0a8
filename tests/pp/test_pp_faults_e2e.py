"""Faults in a -pp 2 group (small random Llama, real processes: scheduler, gateway, one rank per stage): the last
stage killed mid-stream, or SIGSTOPped (the first stage's send of a step's hidden states times out: a gloo send
completes only once the receiver posted its receive), breaks the group; every request is preempted and recomputed
once the group re-forms, every stream ends with transformers' greedy text, every KV block is free at idle, nothing
hangs (each wait has a deadline)."""

from __future__ import annotations

import pytest

from tests.integration.hf_reference import HFReference
from tests.tp.test_tp_faults_e2e import _check, _fault_scenario, _reformed, kill_and_restart, stop_until_detached
from tests.tp.tp_cluster import TpCluster

pytestmark = pytest.mark.slow


@pytest.fixture
def pp2(tmp_path, pp_llama_dir):
    cluster = TpCluster(tmp_path, 2, model=str(pp_llama_dir), collective_timeout=4.0, pipeline_parallel_size=2,
                        scheduler_args=["--hang-timeout", "60"]).start()
    try:
        yield cluster, HFReference(pp_llama_dir), pp_llama_dir.name
    finally:
        cluster.stop()


def test_killed_stage_breaks_the_group_and_it_reforms(pp2):
    cluster, hf, model = pp2
    assert "pipeline stage 1 of 2: layers 1-1, final norm + LM head" in (cluster.log_dir / "worker-1.log").read_text()
    _check(cluster, hf, model, _fault_scenario(cluster, model, kill_and_restart(cluster)))
    assert _reformed(cluster.log_dir / "worker-0.log", "pipeline")


def test_stopped_stage_times_out_the_other_and_the_group_reforms(pp2):
    cluster, hf, model = pp2
    _check(cluster, hf, model, _fault_scenario(cluster, model, stop_until_detached(cluster)))
    assert _reformed(cluster.log_dir / "worker-0.log", "pipeline")
    for rank in (0, 1):
        assert cluster.procs[f"worker-{rank}"].poll() is None, f"worker-{rank} exited"
