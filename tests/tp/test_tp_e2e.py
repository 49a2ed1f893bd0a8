"""Tensor-parallel groups end to end through the official openai SDK: real processes (gateway, scheduler, N
ranks over gloo on loopback); greedy text equals transformers' on the same weights, streamed and not, 16 at once.
(-tp 1 on the same prompts equals transformers in tests/integration/test_openai_e2e.py, so -tp N equals -tp 1.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.cluster import assert_healthy_and_no_leak
from tests.integration.hf_reference import HFReference
from tests.integration.test_openai_e2e import _sixteen_at_once as sixteen_at_once
from tests.tp.tp_cluster import TpCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp3_cluster(tmp_path_factory, model_dir):
    c = TpCluster(tmp_path_factory.mktemp("tp3"), 3)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.mark.parametrize("streamed", [False, True])
def test_tp3_default_model_sixteen_at_once_equal_transformers(tp3_cluster, hf, streamed):
    asyncio.run(sixteen_at_once(tp3_cluster, hf, streamed))


def test_tp3_group_is_whole_and_leaks_nothing(tp3_cluster, hf):
    text = hf.greedy_text(hf.text_ids("Hello"), 8)
    assert_healthy_and_no_leak(tp3_cluster, "Hello", 8, expect_text=text)
    scheduler_log = (tp3_cluster.log_dir / "scheduler.log").read_text()
    assert "3 of 3 ranks in" in scheduler_log
    for rank in range(3):
        assert "joined tensor-parallel group generation 1" in (tp3_cluster.log_dir / f"worker-{rank}.log").read_text()


def test_tp2_small_llama_sixteen_at_once_equal_transformers(tmp_path, tp2_model_dir):
    hf = HFReference(tp2_model_dir)
    cluster = TpCluster(tmp_path, 2, model=str(tp2_model_dir)).start()
    try:
        for streamed in (False, True):
            asyncio.run(sixteen_at_once(cluster, hf, streamed, model=tp2_model_dir.name))
    finally:
        cluster.stop()
