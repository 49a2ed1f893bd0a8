"""The gateway's /metrics on a real cluster: its own HTTP metrics and the scheduler's vllm:* engine metrics in
one scrape, and their increments over a known workload equal what the workload's responses report."""

from __future__ import annotations

import urllib.request

import pytest

from tests.observability.scrape import parse, value, value_or_zero

pytestmark = pytest.mark.slow


def scrape(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(resp.read().decode())


def test_gateway_metrics_include_engine_metrics(cluster):
    before = scrape(cluster)
    long = "Count with me, slowly and carefully: one, two, three, four, five, six, seven, eight, nine, ten,"
    prompts = [long, "One, two, three,", long]
    usages = []
    for prompt in prompts:
        status, body = cluster.post("/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        usages.append(body["usage"])
    after = scrape(cluster)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value_or_zero(before, name, **labels)

    assert delta("http_requests_total", handler="/v1/completions", method="POST", status="200") == 3
    assert delta("http_request_duration_seconds_count", handler="/v1/completions") == 3
    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("vllm:request_success_total") == 3
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prompt_tokens_count"):
        assert delta(name) == 3, name
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert delta("vllm:prefix_cache_hits_total") == cached >= 16      # the repeated prompt's full blocks
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:cache_config_info", num_gpu_blocks="640") == 1
    model = {ls for (n, ls) in after if n == "vllm:generation_tokens_total"}
    assert all(dict(ls)["model_name"] for ls in model)
