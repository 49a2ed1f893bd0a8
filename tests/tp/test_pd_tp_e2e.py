"""Prefill/decode disaggregation between tensor-parallel groups, as real processes: one scheduler (-tp 2) whose decode
group is two ranks (--kv-role decode, each with its host tier) and whose prefill group is two more (--kv-role
prefill, -tp 2), over gloo and loopback TCP. The prefill group's ranks gather their KV heads to rank 0, which
sends whole blocks; the decode group's rank 0 receives and broadcasts, and each rank loads its heads. Greedy text
of requests whose prompts crossed equals transformers' on the same weights (plain, n=2, streamed), every transfer
is confirmed, nothing falls back, and both pools are whole at idle. Then a prefill rank is SIGKILLed as its group
sends (the other rank waiting in the gather): the request completes locally with the same text, the fallback is
counted, the group is down, and the decode pool is whole."""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.api_helpers import client
from tests.integration.hf_reference import HFReference
from tests.integration.cluster import assert_healthy_and_no_leak
from tests.integration.pd_cluster import PROMPTS, assert_both_pools_whole, metric
from tests.tp.tp_cluster import TpCluster

pytestmark = pytest.mark.slow


def start(tmp_path, model_dir, prefill_module: dict[str, str] | None = None) -> TpCluster:
    cluster = TpCluster(tmp_path, 2, model=str(model_dir), num_kv_blocks=160,
                        scheduler_args=["--disagg-policy", "length", "--disagg-min-prompt-tokens", "32"],
                        worker_args=["--kv-role", "decode", "--kv-offloading-size", "0.02", "--max-model-len", "512"])
    for rank in range(2):
        name = f"prefill-{rank}"
        cluster.argv[name] = ["--scheduler-address", cluster.scheduler_address, "--model", str(model_dir),
                              "-tp", "2", "--rank", str(rank), "--num-threads", "1", "--num-kv-blocks", "64",
                              "--max-model-len", "512", "--kv-role", "prefill"]
        cluster.modules[name] = (prefill_module or {}).get(name, "steploop.gpu_worker")
    try:
        for name in ("prefill-1", "prefill-0"):
            cluster.start_service(name)
        cluster.start()
        cluster._wait(lambda: metric(cluster, "steploop:pd_prefill_group_up") == 1.0, 600, "no prefill group")
    except BaseException:
        stop(cluster)
        raise
    return cluster


def stop(cluster: TpCluster) -> None:
    cluster.stop()
    for name in ("prefill-0", "prefill-1"):
        if name in cluster.procs:
            cluster.stop_service(name, timeout=15)


def test_prompts_cross_from_a_two_rank_prefill_group_to_a_two_rank_decode_group_exactly(tmp_path, tp2_model_dir):
    hf = HFReference(tp2_model_dir)
    model = tp2_model_dir.name
    cluster = start(tmp_path, tp2_model_dir)
    try:
        want = [hf.greedy_text(hf.text_ids(p), 8) for p in PROMPTS[:3]]
        openai = client(cluster)
        extra = {"disaggregation": "disaggregated"}
        got = openai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body=extra)
        assert got.choices[0].text == want[0]
        got = openai.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0, n=2,
                                        extra_body=extra)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [want[1], want[1]]
        stream = openai.completions.create(model=model, prompt=PROMPTS[2], max_tokens=8, temperature=0, stream=True,
                                           extra_body=extra)
        assert "".join(chunk.choices[0].text for chunk in stream) == want[2]
        assert metric(cluster, "steploop:pd_kv_transfers_total") >= 3
        assert metric(cluster, "steploop:pd_fallbacks_total") == 0
        assert metric(cluster, "steploop:pd_kv_transfer_bytes_total") > 0
        scheduler_log = (cluster.log_dir / "scheduler.log").read_text()
        assert "prefill group tp-group" in scheduler_log and "(-tp 2)" in scheduler_log
        assert_both_pools_whole(cluster, model)
        for name in (*cluster.ranks, "prefill-0", "prefill-1"):      # no step failed and was recomputed quietly
            assert " ERROR " not in (cluster.log_dir / f"{name}.log").read_text(), name
    finally:
        stop(cluster)


def test_a_prefill_rank_killed_mid_transfer_leaves_the_request_to_complete_locally(tmp_path, tp2_model_dir):
    hf = HFReference(tp2_model_dir)
    model = tp2_model_dir.name
    cluster = start(tmp_path, tp2_model_dir, {"prefill-1": "tests.tp.dying_prefill_rank"})
    try:
        want = hf.greedy_text(hf.text_ids(PROMPTS[0]), 8)
        got = client(cluster).completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                 extra_body={"disaggregation": "disaggregated"})
        assert got.choices[0].text == want
        assert cluster.procs["prefill-1"].wait(60) == -signal.SIGKILL
        assert metric(cluster, "steploop:pd_fallbacks_total") == 1
        assert metric(cluster, "steploop:pd_kv_transfers_total") == 0
        deadline = time.monotonic() + 60       # the scheduler saw the rank's stream end (its group is closed)
        while metric(cluster, "steploop:pd_prefill_group_up") != 0.0:
            assert time.monotonic() < deadline, "the prefill group is still up"
            time.sleep(0.2)                     # a poll interval
        assert cluster.procs["prefill-0"].poll() is None     # the surviving rank left the group and lives on
        assert_healthy_and_no_leak(cluster, "Hello", 4, timeout=60, model=model)
    finally:
        stop(cluster)
