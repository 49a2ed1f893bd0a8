"""Killing the worker in the middle of streamed requests: a restarted worker reattaches, every request is
recomputed and completes with the same text as transformers' greedy generation; then a new request is served,
still greedy-exact, and at idle every KV block is free."""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from tests.integration.cluster import Cluster, assert_healthy_and_no_leak

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The history of the Roman Empire", "A recipe for pancakes:", "In computer science, a hash table",
           "The weather today is"]
MAX_TOKENS = 40


async def _stream(client, prompt, progress: dict, model: str = MODEL, max_tokens: int = MAX_TOKENS):
    stream = await client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=max_tokens,
                                             stream=True)
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            progress[prompt] = len(text)
    return text


async def until_streaming(progress: dict, tasks: list, timeout: float = 120.0) -> None:
    """Until every stream has produced text (`progress` has an entry per prompt)."""
    deadline = time.monotonic() + timeout
    while len(progress) < len(tasks):
        assert time.monotonic() < deadline, f"only {len(progress)} of {len(tasks)} streams started"
        assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
        await asyncio.sleep(0.05)        # a poll interval


def test_killed_worker_restarts_and_requests_finish_unchanged(tmp_path, model_dir, hf):
    cluster = Cluster(tmp_path).start()
    try:
        async def scenario():
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
            progress: dict = {}
            tasks = [asyncio.create_task(_stream(client, p, progress)) for p in PROMPTS]
            await until_streaming(progress, tasks)
            cluster.stop_service("worker", sig=signal.SIGKILL)
            log = tmp_path / "scheduler.log"
            deadline = time.monotonic() + 60
            while "detached" not in log.read_text():         # the scheduler noticed, then the worker comes back
                assert time.monotonic() < deadline, "the scheduler never noticed the killed worker"
                await asyncio.sleep(0.05)
            cluster.start_service("worker")
            texts = await asyncio.wait_for(asyncio.gather(*tasks), 240)
            await client.close()
            return texts

        texts = asyncio.run(scenario())
        for prompt, text in zip(PROMPTS, texts):
            assert text == hf.greedy_text(hf.text_ids(prompt), MAX_TOKENS), prompt
        assert "detached" in (tmp_path / "scheduler.log").read_text()
        assert_healthy_and_no_leak(cluster, PROMPTS[0], 8, expect_text=hf.greedy_text(hf.text_ids(PROMPTS[0]), 8))
    finally:
        cluster.stop()
