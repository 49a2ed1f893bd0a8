"""Two scheduler replicas, each with its own worker, behind one gateway (--scheduler-address A,B): real processes.
The same greedy text whichever replica serves, one prompt's repeats hit one replica's prefix cache, a killed
scheduler is routed around, and /metrics shows both replicas."""

from __future__ import annotations

import signal
import urllib.request

import pytest

from tests.integration.cluster import MODEL, two_replicas

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_dir):
    with two_replicas(tmp_path_factory, "replica", num_kv_blocks=640) as pair:
        yield pair


def complete(cluster, prompt, **extra):
    return cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                            **extra})


def test_replicas_share_the_load_and_give_the_same_text(replicas, hf):
    a, b = replicas
    prompts = [f"Question {i}: name a colour and a fruit that is that colour." for i in range(8)]
    for p in prompts:
        status, body = complete(a, p)
        assert status == 200, body
        assert body["choices"][0]["text"] == hf.greedy_text(hf.text_ids(p), 6), p
    served = [a.load_report().num_steps, b.load_report().num_steps]
    assert min(served) > 0, served           # both replicas ran steps


def test_repeats_of_a_long_prompt_hit_one_replicas_cache(replicas):
    a, _ = replicas
    shared = "You are a careful assistant. " * 24        # ~150 tokens, then a short question
    cached = [complete(a, shared + f"Q{i}?")[1]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(4)]
    assert all(c >= 128 for c in cached[1:]), cached     # the 2nd..4th went where the 1st left its blocks


def test_metrics_label_both_replicas(replicas):
    a, b = replicas
    with urllib.request.urlopen(a.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    for address in (a.scheduler_address, b.scheduler_address):
        assert f'replica="{address}"' in text
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1


def test_a_killed_scheduler_is_routed_around(replicas, hf):
    a, b = replicas
    b.stop_service("scheduler", sig=signal.SIGKILL)
    for i in range(6):
        p = f"After the failure, request {i}:"
        status, body = complete(a, p)
        assert status == 200, body
        assert body["choices"][0]["text"] == hf.greedy_text(hf.text_ids(p), 6)
    assert a.health() == 200
