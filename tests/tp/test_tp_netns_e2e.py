"""A -tp 2 group across two "hosts": rank 1 in its own network namespace (joined by a veth pair), rank 0,
scheduler and gateway in this one; the ranks meet at the addresses they advertise (--tp-host), not loopback.
Cutting the link mid-stream (no FIN, no RST) breaks the group: rank 0's collective times out, keepalive drops
rank 1's plan stream; once the link is back the group re-forms and every stream ends with transformers' text."""

from __future__ import annotations

import time

import pytest

from tests.integration.cluster import assert_healthy_and_no_leak
from tests.integration.hf_reference import HFReference
from tests.integration.netns import HOST_ADDR, PEER_ADDR, LinkedNamespace, netns_available
from tests.tp.test_tp_faults_e2e import MAX_TOKENS, PROMPTS, _fault_scenario, _wait_for_log, _wait_for_reformed
from tests.tp.tp_cluster import TpCluster

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 for network namespaces")]


def cut_link_scenario(tmp_path, model_dir, group: str, **cluster_args) -> None:
    """Rank 1 of a 2-rank group (`cluster_args`: its -tp/-pp sizes) in its own namespace; the link cut mid-stream
    and restored once the group broke and the scheduler detached; every stream ends with transformers' text and
    the re-formed group serves again with no block leaked. `group`: the group's name in the workers' logs."""
    hf = HFReference(model_dir)
    with LinkedNamespace(f"{group[:2]}{int(time.time()) % 100000}") as ns:
        cluster = TpCluster(tmp_path, 2, model=str(model_dir), collective_timeout=4.0,
                            scheduler_args=["--scheduler-host", HOST_ADDR, "--hang-timeout", "60"],
                            prefixes={"worker-1": ns.prefix()}, **cluster_args)
        cluster.scheduler_address = f"{HOST_ADDR}:{cluster.grpc_port}"
        cluster.argv["gateway"][3] = cluster.scheduler_address
        for rank, host in ((0, HOST_ADDR), (1, PEER_ADDR)):
            cluster.argv[f"worker-{rank}"][1] = cluster.scheduler_address
            cluster.argv[f"worker-{rank}"] += ["--tp-host", host]
        try:
            cluster.start()
            assert f"at {HOST_ADDR}:" in (tmp_path / "worker-1.log").read_text()   # the store on rank 0's host

            def cut_then_restore():
                ns.cut()
                try:
                    _wait_for_log(tmp_path / "worker-0.log", "tensor-parallel group broke", timeout=60)
                    _wait_for_log(tmp_path / "scheduler.log", "detached", timeout=60)
                finally:
                    ns.restore()

            texts = _fault_scenario(cluster, model_dir.name, cut_then_restore)
            for prompt, text in zip(PROMPTS, texts):
                assert text == hf.greedy_text(hf.text_ids(prompt), MAX_TOKENS), prompt
            _wait_for_reformed(tmp_path / "worker-1.log", timeout=120, group=group)
            assert_healthy_and_no_leak(cluster, PROMPTS[0], 8, model=model_dir.name,
                                       expect_text=hf.greedy_text(hf.text_ids(PROMPTS[0]), 8))
        finally:
            cluster.stop()


def test_ranks_on_two_hosts_survive_a_cut_link(tmp_path, tp2_model_dir):
    cut_link_scenario(tmp_path, tp2_model_dir, "tensor-parallel")
