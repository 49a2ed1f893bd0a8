"""Faults in a -tp 2 group (small random Llama, real processes): a rank killed mid-stream, or SIGSTOPped (its
peer's collective times out), breaks the group; every request is preempted and recomputed once the group
re-forms, every stream ends with transformers' greedy text, every KV block is free at idle, nothing is stuck."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import openai
import pytest

from tests.integration.cluster import assert_healthy_and_no_leak
from tests.integration.hf_reference import HFReference
from tests.integration.test_worker_restart_e2e import _stream, until_streaming
from tests.tp.tp_cluster import TpCluster

pytestmark = pytest.mark.slow

PROMPTS = ["The history of the Roman Empire", "A recipe for pancakes:", "In computer science, a hash table",
           "The weather today is"]
MAX_TOKENS = 48


def _wait_for_log(path, needle: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{needle!r} not in {path.name} after {timeout} s"
        time.sleep(0.1)


def _reformed(path, group: str = "tensor-parallel") -> bool:
    """The rank joined a group formed after its first: generation 2, or later when a re-formation itself broke
    (a rank re-attaching while a cut link still drops some of its packets waits out gRPC's keepalive first).
    `group`: "tensor-parallel", or "pipeline" for a -pp group."""
    joined = re.findall(rf"joined {group} group generation (\d+)", path.read_text(errors="replace"))
    return any(int(g) >= 2 for g in joined)


def _wait_for_reformed(path, timeout: float = 120.0, group: str = "tensor-parallel") -> None:
    deadline = time.monotonic() + timeout
    while not _reformed(path, group):
        assert time.monotonic() < deadline, f"{path.name}: no re-formed group after {timeout} s"
        time.sleep(0.1)


def _fault_scenario(cluster: TpCluster, model: str, fault) -> list[str]:
    async def scenario():
        client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
        progress: dict = {}
        tasks = [asyncio.create_task(_stream(client, p, progress, model, MAX_TOKENS)) for p in PROMPTS]
        await until_streaming(progress, tasks)
        await asyncio.get_running_loop().run_in_executor(None, fault)
        texts = await asyncio.wait_for(asyncio.gather(*tasks), 400)
        await client.close()
        return texts
    return asyncio.run(scenario())


def kill_and_restart(cluster: TpCluster, service: str = "worker-1"):
    """The fault: SIGKILL a rank, wait until the scheduler detached the broken group, start the rank again."""
    def fault():
        cluster.stop_service(service, sig=signal.SIGKILL)
        _wait_for_log(cluster.log_dir / "scheduler.log", "detached")      # the group broke; now it re-forms
        cluster.start_service(service)
    return fault


def stop_until_detached(cluster: TpCluster, service: str = "worker-1"):
    """The fault: SIGSTOP a rank until its peer's collective timed out and the scheduler detached the group."""
    def fault():
        cluster.procs[service].send_signal(signal.SIGSTOP)
        try:
            _wait_for_log(cluster.log_dir / "worker-0.log", "tensor-parallel group broke")
            _wait_for_log(cluster.log_dir / "scheduler.log", "detached")
        finally:
            cluster.procs[service].send_signal(signal.SIGCONT)
    return fault


@pytest.fixture
def tp2(tmp_path, tp2_model_dir):
    cluster = TpCluster(tmp_path, 2, model=str(tp2_model_dir), collective_timeout=4.0,
                        scheduler_args=["--hang-timeout", "60"]).start()
    try:
        yield cluster, HFReference(tp2_model_dir), tp2_model_dir.name
    finally:
        cluster.stop()


def _check(cluster, hf, model, texts) -> None:
    for prompt, text in zip(PROMPTS, texts):
        assert text == hf.greedy_text(hf.text_ids(prompt), MAX_TOKENS), prompt
    assert "detached" in (cluster.log_dir / "scheduler.log").read_text()
    assert "2 of 2 ranks in" in (cluster.log_dir / "scheduler.log").read_text()
    assert_healthy_and_no_leak(cluster, PROMPTS[0], 8, expect_text=hf.greedy_text(hf.text_ids(PROMPTS[0]), 8),
                               model=model)


def test_killed_rank_breaks_the_group_and_it_reforms(tp2):
    cluster, hf, model = tp2
    _check(cluster, hf, model, _fault_scenario(cluster, model, kill_and_restart(cluster)))
    assert _reformed(cluster.log_dir / "worker-0.log")


def test_stopped_rank_times_out_its_peer_and_the_group_reforms(tp2):
    cluster, hf, model = tp2
    _check(cluster, hf, model, _fault_scenario(cluster, model, stop_until_detached(cluster)))
    for rank in (0, 1):
        assert cluster.procs[f"worker-{rank}"].poll() is None, f"worker-{rank} exited"
