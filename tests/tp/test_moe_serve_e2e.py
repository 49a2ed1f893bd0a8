"""`steploop serve -tp 2 --enable-expert-parallel` on a random Qwen2-MoE folder (shared expert, a dense layer
between the sparse ones): one command starts the scheduler, two ranks and the gateway; each rank logs the
experts it holds, and greedy completions through the openai SDK, several at once, equal transformers'."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.hf_reference import HFReference
from tests.integration.serve_process import ServeProcess
from tests.worker.family_models import build_family_model

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def test_serve_expert_parallel_places_experts_and_serves_greedy_text(tmp_path, model_dir):
    path = build_family_model("qwen2_moe", tmp_path / "qwen2-moe", model_dir)
    hf = HFReference(path)
    serve = ServeProcess(tmp_path, "--model", str(path), "-tp", "2", "--enable-expert-parallel",
                         "--num-kv-blocks", "256")
    try:
        serve.wait_ready(600)
        serve.wait_for_log("expert parallel over 2 ranks, 3 experts each: rank 0: experts 0-2, rank 1: experts 3-5")
        client = openai.OpenAI(base_url=serve.cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=300)

        def complete(prompt: str) -> str:
            return client.completions.create(model=path.name, prompt=prompt, temperature=0,
                                             max_tokens=12).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, PROMPTS))
        for prompt, text in zip(PROMPTS, texts):
            assert text == hf.greedy_text(hf.text_ids(prompt), 12), prompt
    finally:
        os.killpg(serve.proc.pid, signal.SIGTERM)
        serve.proc.wait(120)
