"""generation_config.json's sampling defaults through the real cluster (worker -> WorkerHello -> scheduler ->
ModelInfo -> gateway) with the openai SDK: the default model with a generation_config recommending top_k 1 (so
sampling is the argmax whatever the temperature) and max_new_tokens 5."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

RECOMMENDED = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_k": 1,
               "max_new_tokens": 5}
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def client(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("model")
    for f in model_dir.iterdir():
        if f.name != "generation_config.json":
            (path / f.name).symlink_to(f)
    (path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    worker = ["--model", str(path), "--device", "cpu", "--max-model-len", "512"]
    cluster = Cluster(tmp_path_factory.mktemp("cluster"), worker_args=worker,
                      gateway_args=["--model", str(path), "--served-model-name", "m"], num_kv_blocks=64)
    try:
        cluster.start()
        yield openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert "Default sampling parameters have been overridden" in cluster.logs()
    finally:
        cluster.stop()


def test_requests_that_set_nothing_get_the_models_defaults(client):
    greedy = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=5,
                                       extra_body={"ignore_eos": True})
    for seed in (1, 2):          # top_k 1 from the file: any seed gives the argmax; max_tokens 5 from the file
        got = client.completions.create(model="m", prompt=PROMPT, seed=seed, extra_body={"ignore_eos": True})
        assert got.choices[0].text == greedy.choices[0].text and got.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count to twenty."}],
                                          max_tokens=50, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"   # capped, as vLLM


def test_fields_the_request_sets_win(client):
    tokens = [client.completions.create(model="m", prompt=PROMPT, temperature=2.0, seed=seed,
                                        max_tokens=4, extra_body={"ignore_eos": True, "top_k": -1}).choices[0].text
              for seed in range(4)]
    assert len(set(tokens)) > 1          # top_k -1 and temperature 2: real sampling, the seeds differ
