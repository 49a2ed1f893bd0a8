"""On the real model, greedy outputs do not depend on how the scheduler ran them: prefix caching, async
scheduling, n-gram speculation on or off, or a KV pool so small that requests are preempted."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 32
# Repetitive prompts give the n-gram proposer something to find; a shared preamble gives prefix hits.
PREAMBLE = "You are reading a list. Apples, pears, plums. Apples, pears, plums. Apples, pears, plums. "
PROMPTS = [PREAMBLE + "Next:", PREAMBLE + "The list again:", "1, 2, 3, 4, 5, 6, 7, 8,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]

CONFIGS = {
    "no-prefix-caching": (["--no-enable-prefix-caching"], [], 640),
    "no-async-scheduling": (["--no-async-scheduling"], [], 640),
    "ngram-speculation": (["--speculative-ngram", "4"], [], 640),
    # 12 blocks of 16 tokens for 4 requests of ~60 tokens each: preemption is certain.
    "tiny-kv-pool": ([], ["--max-model-len", "128"], 12),
}


async def _run_all(base_url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    replies = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, temperature=0,
                                                               max_tokens=MAX_TOKENS) for p in PROMPTS))
    await client.close()
    return [r.choices[0].text for r in replies]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_text_is_schedule_independent(tmp_path, model_dir, hf, name):
    scheduler_args, worker_args, blocks = CONFIGS[name]
    cluster = Cluster(tmp_path, scheduler_args=scheduler_args, worker_args=worker_args, num_kv_blocks=blocks)
    try:
        cluster.start()
        texts = asyncio.run(_run_all(cluster.base_url))
    finally:
        cluster.stop()
    for prompt, text in zip(PROMPTS, texts):
        assert text == hf.greedy_text(hf.text_ids(prompt), MAX_TOKENS), (name, prompt)
    if name == "tiny-kv-pool":
        assert "; it will be recomputed" in (tmp_path / "scheduler.log").read_text()   # a real preemption


def test_repeated_long_prompt_hits_the_prefix_cache(cluster, hf):
    prompt = "The following is a long report about the economy. " * 12
    n_prompt = len(hf.text_ids(prompt))
    c = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)
    first = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    second = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.choices[0].text == second.choices[0].text
    assert 0 < cached < n_prompt and cached % 16 == 0 and cached >= n_prompt - 16, (cached, n_prompt)


def test_cache_salt_separates_tenants(cluster):
    """vLLM's `cache_salt`: the same prompt under another salt shares no prefix-cache block."""
    prompt = "Tenant isolation check: the quarterly numbers for the northern region follow. " * 8
    c = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)

    def cached(salt: str) -> int:
        r = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2,
                                 extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0            # the same tenant hits its own blocks
    assert cached("tenant-b") == 0           # another tenant hits none of them
