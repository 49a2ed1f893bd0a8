"""`steploop serve -tp 2 -pp 2` on a random Qwen3-MoE folder (3 layers: stage 0 holds 2, stage 1 one; a dense
layer between sparse ones; one KV head replicated): one command starts the scheduler, four ranks as separate
processes and the gateway; each stage logs the layers it holds, and greedy completions through the openai SDK,
several at once, equal transformers'."""

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


def test_serve_tp2_pp2_moe_serves_greedy_text(tmp_path, model_dir):
    path = build_family_model("qwen3_moe", tmp_path / "qwen3-moe", model_dir)
    hf = HFReference(path)
    serve = ServeProcess(tmp_path, "--model", str(path), "-tp", "2", "-pp", "2", "--num-kv-blocks", "256")
    try:
        serve.wait_ready(600)
        serve.wait_for_log("pipeline stage 0 of 2: layers 0-1, embedding")
        serve.wait_for_log("pipeline stage 1 of 2: layers 2-2, final norm + LM head + sampling")
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
