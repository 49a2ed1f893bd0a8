"""`steploop serve -tp 3`: one command starts the scheduler, three worker ranks and the gateway; the group
forms, and a greedy chat through the openai SDK equals transformers'. SIGTERM stops every rank."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from tests.integration.serve_process import ServeProcess, alive

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_serve_tp3_starts_three_ranks_and_serves_greedy_text(tmp_path, hf):
    serve = ServeProcess(tmp_path, "-tp", "3", "--num-kv-blocks", "640")
    try:
        serve.wait_ready(600)
        assert len(serve.pids("worker")) == 1 and len(serve.pids("worker-1")) == len(serve.pids("worker-2")) == 1
        client = openai.OpenAI(base_url=serve.cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0,
                                               max_tokens=16)
        assert reply.choices[0].message.content == hf.greedy_text(hf.chat_ids(MESSAGES), 16)
    finally:
        ranks = [pid for name in ("worker", "worker-1", "worker-2") for pid in serve.pids(name)]
        os.killpg(serve.proc.pid, signal.SIGTERM)
        serve.proc.wait(120)
    assert not [pid for pid in ranks if alive(pid)]
