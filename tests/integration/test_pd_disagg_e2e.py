"""Prefill/decode disaggregation on a real cluster: one scheduler, a decode worker (--kv-role decode, host tier for
received blocks), a prefill worker (--kv-role prefill), a gateway. Greedy output equals a one-group run (transformers,
or the same request forced local) for plain, streamed, n=2, json_schema and top-5 logprobs requests whose prompts
ran on the prefill group (forced, or where --disagg-policy cost chose it) and whose KV moved over TCP; a LoRA
request's prompt runs on the prefill group too (it loads the adapter as the decode group does), exact against
transformers + peft; a client that disconnects while its prompt is on the prefill group leaves no request and no block
behind; a block corrupted in flight (the test hook) is refused by its checksum and recomputed on the decode group
(counted); a SIGKILLed prefill worker leaves its requests to complete locally. Every case ends with no KV block
held on either side.

The tests on the module's cluster share it in file order; the SIGKILL test goes last (it takes the prefill group
down)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from tests.integration.api_helpers import client
from tests.integration.cluster import Cluster, assert_healthy_and_no_leak
from tests.integration.pd_cluster import (
    LONG,
    MODEL,
    PROMPTS,
    assert_both_pools_whole,
    complete,
    metric,
    pd_cluster,
    stop,
)
from tests.lora.adapters import RECIPES, PeftReference, make_adapter

pytestmark = pytest.mark.slow

ADAPTER = RECIPES[0]                    # attention-only, rank 8
SCHEMA = {"type": "object", "properties": {"job": {"type": "string", "enum": ["teacher", "doctor", "mayor"]},
                                           "boats": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["job", "boats"], "additionalProperties": False}


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return make_adapter(model_dir, tmp_path_factory.mktemp("pd-adapter"), ADAPTER)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, adapter_dir):
    lora = ["--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"{ADAPTER.name}={adapter_dir}"]
    cluster = pd_cluster(tmp_path_factory.mktemp("pd-cluster"), lora=lora)
    try:
        yield cluster
    finally:
        stop(cluster)


def test_disaggregated_requests_match_one_group(pd, hf):
    cluster = pd
    fallbacks = metric(cluster, "steploop:pd_fallbacks_total")
    want = [hf.greedy_text(hf.text_ids(p), 8) for p in PROMPTS]
    assert complete(cluster, PROMPTS[0], disaggregation="disaggregated") == [want[0]]
    assert metric(cluster, "steploop:pd_kv_transfers_total") >= 1, "the prompt did not go through the prefill group"
    assert complete(cluster, PROMPTS[1], n=2) == [want[1], want[1]]
    stream = client(cluster).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                                stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == want[2]
    assert complete(cluster, PROMPTS[3], disaggregation="local") == [want[3]]
    decided = metric(cluster, "steploop:pd_decisions_total")
    results: dict[int, list[str]] = {}          # concurrent, each where --disagg-policy cost chooses: exact either way
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(cluster, PROMPTS[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results[i] for i in range(len(PROMPTS))] == [[w] for w in want]
    assert metric(cluster, "steploop:pd_decisions_total") == decided + len(PROMPTS)
    assert metric(cluster, "steploop:pd_fallbacks_total") == fallbacks
    assert metric(cluster, "steploop:pd_kv_transfer_bytes_total") > 0
    assert_both_pools_whole(cluster)


def chat(cluster: Cluster, mode: str, salt: str, **extra):
    """A greedy chat request on PROMPTS[0], forced `mode`; its own cache salt, so a local run and a disaggregated
    one share no cached block and each computes the prompt itself."""
    return client(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0,
        extra_body={"disaggregation": mode, "cache_salt": salt}, **extra)


def test_json_schema_and_logprobs_match_a_local_run(pd):
    cluster = pd
    transfers, fallbacks = (metric(cluster, f"steploop:pd_{m}_total") for m in ("kv_transfers", "fallbacks"))
    fmt = {"type": "json_schema", "json_schema": {"name": "morning", "schema": SCHEMA}}
    local, disagg = (chat(cluster, mode, f"json-{mode}", max_tokens=32, response_format=fmt).choices[0]
                     for mode in ("local", "disaggregated"))
    assert disagg.message.content == local.message.content and disagg.finish_reason == local.finish_reason
    if local.finish_reason == "stop":
        assert set(json.loads(local.message.content)) == {"job", "boats"}

    def top5(mode):
        choice = chat(cluster, mode, f"lp-{mode}", max_tokens=8, logprobs=True, top_logprobs=5).choices[0]
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in choice.logprobs.content]

    # steploop has no return_tokens_as_token_ids: tokens are compared as their text, position by position
    local, disagg = top5("local"), top5("disaggregated")
    assert [t for t, _, _ in disagg] == [t for t, _, _ in local] and len(local) == 8
    for (_, lp_d, top_d), (_, lp_l, top_l) in zip(disagg, local):
        assert abs(lp_d - lp_l) <= 1e-4 and len(top_l) == 5
        assert [t for t, _ in top_d] == [t for t, _ in top_l], (top_d, top_l)
        assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(top_d, top_l)), (top_d, top_l)
    assert metric(cluster, "steploop:pd_kv_transfers_total") == transfers + 2, "not both disaggregated"
    assert metric(cluster, "steploop:pd_fallbacks_total") == fallbacks
    assert_both_pools_whole(cluster)


def test_a_lora_request_crosses_with_its_adapter_exact_and_counted(pd, hf, model_dir, adapter_dir):
    cluster = pd
    names = ("disaggregated_requests", "local_requests", "kv_transfers")
    before = {m: metric(cluster, f"steploop:pd_{m}_total") for m in names}
    peft = PeftReference(model_dir, {ADAPTER.name: adapter_dir})
    want = peft.greedy_text(ADAPTER.name, peft.tokenizer(PROMPTS[1]).input_ids, 8)
    assert want != hf.greedy_text(hf.text_ids(PROMPTS[1]), 8), "the adapter changed nothing"
    status, body = cluster.post("/v1/completions", {"model": ADAPTER.name, "prompt": PROMPTS[1], "max_tokens": 8,
                                                    "temperature": 0, "disaggregation": "disaggregated"})
    assert status == 200 and body["choices"][0]["text"] == want, body
    after = {m: metric(cluster, f"steploop:pd_{m}_total") for m in names}
    assert after == {**before, "disaggregated_requests": before["disaggregated_requests"] + 1,
                     "kv_transfers": before["kv_transfers"] + 1}      # its prompt ran on the prefill group
    assert_both_pools_whole(cluster)


def test_a_client_gone_while_its_prompt_is_on_the_prefill_group_frees_both_sides(pd):
    cluster = pd
    aborts, fallbacks = (metric(cluster, n) for n in ("steploop:request_aborts_total", "steploop:pd_fallbacks_total"))
    body = json.dumps({"model": MODEL, "prompt": LONG[0], "max_tokens": 200, "temperature": 0, "stream": True,
                       "ignore_eos": True, "disaggregation": "disaggregated"}).encode()
    sock = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120
        while metric(cluster, "steploop:pd_prefill_requests") < 1:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.02)                 # a poll interval
    finally:
        sock.close()                         # gone before a token (200 of them, no EOS: only an abort ends it)
    deadline = time.monotonic() + 60
    while metric(cluster, "steploop:pd_prefill_requests") > 0:
        assert time.monotonic() < deadline, "the aborted request is still on the prefill group"
        time.sleep(0.05)                     # a poll interval
    assert_both_pools_whole(cluster)         # no request left: not decoding its 200 tokens either
    assert metric(cluster, "steploop:request_aborts_total") == aborts + 1   # ended by the abort, not a fallback
    assert metric(cluster, "steploop:pd_fallbacks_total") == fallbacks


def test_a_sigkilled_prefill_worker_leaves_its_requests_to_complete_locally(pd, hf):
    cluster = pd
    fallbacks = metric(cluster, "steploop:pd_fallbacks_total")
    results: dict[int, list[str]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, complete(cluster, LONG[i], 8, disaggregation="disaggregated"))) for i in range(len(LONG))]
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
    assert metric(cluster, "steploop:pd_fallbacks_total") >= fallbacks + 1
    want = hf.greedy_text(hf.text_ids(PROMPTS[0]), 8)
    assert complete(cluster, PROMPTS[0]) == [want]    # the prefill group is down: local
    assert metric(cluster, "steploop:pd_prefill_group_up") == 0
    assert_healthy_and_no_leak(cluster, "Hello", 4, timeout=60)


def test_corrupted_block_is_recomputed_and_counted(tmp_path, model_dir, hf):
    cluster = pd_cluster(tmp_path, env={"STEPLOOP_TEST_CORRUPT_KV_TRANSFER": "1"})
    try:
        for prompt in PROMPTS[:2]:
            assert complete(cluster, prompt, disaggregation="disaggregated") == [hf.greedy_text(hf.text_ids(prompt), 8)]
        assert metric(cluster, "steploop:pd_fallbacks_total") >= 2
        assert metric(cluster, "steploop:pd_kv_transfer_failures_total") >= 2
        assert metric(cluster, "steploop:pd_kv_transfers_total") == 0
        assert "checksum mismatch" in (tmp_path / "worker.log").read_text()
        assert_both_pools_whole(cluster)
    finally:
        stop(cluster)
