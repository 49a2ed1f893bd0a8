"""Embeddings through a real cluster (gateway, scheduler, a `--runner pooling` worker) with the official openai
SDK, against transformers' pooled, normalized final hidden state of the same weights: float and base64, a batch
of many inputs with shared prefixes (sent twice: the second time from the prefix cache), chunked prompts (a
16-token budget), last-token pooling on the default model and mean pooling on a small random model. Then the
embeddings bad-input table in OpenAI's shape, and the engine still serves after it."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from tests.integration.cluster import Cluster, is_idle_and_whole
from tests.worker.family_models import build_family_model
from tests.worker.test_pooling import write_sentence_transformers

pytestmark = pytest.mark.slow

M = "SmolLM2-135M-Instruct"
EMB = "/v1/embeddings"
PREFIX = "Steploop serves language models with one loop that counts tokens. "
TEXTS = [PREFIX * (1 + i % 3) + f"Sentence number {i} is about {w}." for i, w in
         enumerate(["cats", "dogs", "rivers", "prime numbers", "Paris", "the sea", "tea", "trains"] * 3)]


def start(tmp_path_factory, name: str, worker_args=(), gateway_args=()) -> Cluster:
    return Cluster(tmp_path_factory.mktemp(name), worker_args=["--runner", "pooling", *worker_args],
                   gateway_args=list(gateway_args), num_kv_blocks=640,
                   scheduler_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "8"]).start()


@pytest.fixture(scope="module")
def pooling_cluster(tmp_path_factory, model_dir):
    cluster = start(tmp_path_factory, "pool-default")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def mean_model(tmp_path_factory, model_dir):
    path = build_family_model("qwen3", tmp_path_factory.mktemp("mean-qwen3"), model_dir, seed=5)
    write_sentence_transformers(path, "mean_tokens", True)
    return path


def reference(folder, texts: list[str], kind: str) -> list[torch.Tensor]:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            hidden = model(torch.tensor([tok(text).input_ids])).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(hidden[-1] if kind == "LAST" else hidden.mean(0), dim=-1))
    return out


def assert_matches(got, want: list[torch.Tensor]) -> None:
    assert [d.index for d in got.data] == list(range(len(want)))
    for item, ref in zip(got.data, want):
        vec = torch.tensor(item.embedding, dtype=torch.float32)
        assert (vec - ref).abs().max().item() < 1e-4
        assert torch.nn.functional.cosine_similarity(vec, ref, dim=0).item() >= 0.9999


def sdk(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


def test_sdk_embeddings_equal_transformers_last_token(pooling_cluster, model_dir):
    client, want = sdk(pooling_cluster), reference(model_dir, TEXTS, "LAST")
    floats = client.embeddings.create(model=M, input=TEXTS, encoding_format="float")
    assert_matches(floats, want)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert floats.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in TEXTS)
    base64 = client.embeddings.create(model=M, input=TEXTS)   # the SDK asks for base64 and decodes it
    assert_matches(base64, want)                              # (the second time, prefixes come from the cache)
    one = client.embeddings.create(model=M, input=tok(TEXTS[3]).input_ids)   # token ids
    assert_matches(one, want[3:4])
    assert is_idle_and_whole(pooling_cluster.wait_idle())


def test_models_say_what_they_serve_and_the_wrong_api_is_a_400(pooling_cluster):
    client = sdk(pooling_cluster)
    assert client.models.list().data[0].model_extra["tasks"] == ["embed"]
    with pytest.raises(openai.BadRequestError, match="The model does not support Chat Completions API"):
        client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="The model does not support Completions API"):
        client.completions.create(model=M, prompt="hi")
    spec = json.loads(urllib.request.urlopen(pooling_cluster.base_url + "/openapi.json").read())
    assert "/v1/embeddings" in spec["paths"]


EMBEDDINGS_BAD_INPUTS = [
    ("missing input", {"model": M}, "missing_required_parameter"),
    ("empty string", {"model": M, "input": ""}, "empty_input"),
    ("empty list", {"model": M, "input": []}, "empty_input"),
    ("empty string in a list", {"model": M, "input": ["a", ""]}, "empty_input"),
    ("empty token list in a list", {"model": M, "input": [[1, 2], []]}, "empty_input"),
    ("input a number", {"model": M, "input": 5}, "invalid_type"),
    ("input an object", {"model": M, "input": {"text": "a"}}, "invalid_type"),
    ("strings and ids mixed", {"model": M, "input": ["a", 5]}, "invalid_type"),
    ("out-of-vocabulary token id", {"model": M, "input": [1, 10 ** 6]}, "invalid_value"),
    ("negative token id", {"model": M, "input": [[1, -3]]}, "invalid_value"),
    ("too long", {"model": M, "input": "word " * 9000}, "context_length_exceeded"),
    ("too many inputs", {"model": M, "input": ["a"] * 2049}, "invalid_value"),
    ("encoding_format unknown", {"model": M, "input": "a", "encoding_format": "int8"}, "invalid_value"),
    ("dimensions without matryoshka", {"model": M, "input": "a", "dimensions": 64}, "invalid_value"),
    ("dimensions zero", {"model": M, "input": "a", "dimensions": 0}, "invalid_value"),
    ("user a number", {"model": M, "input": "a", "user": 7}, "invalid_type"),
]


@pytest.mark.parametrize("name,body,code", EMBEDDINGS_BAD_INPUTS, ids=[r[0] for r in EMBEDDINGS_BAD_INPUTS])
def test_embeddings_bad_input_is_a_400_in_openai_shape(pooling_cluster, name, body, code):
    status, reply = pooling_cluster.post(EMB, body)
    assert status == 400, (name, reply)
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["code"] == code, reply


def test_engine_still_embeds_after_the_table(pooling_cluster, model_dir):
    status, reply = pooling_cluster.post(EMB, {"model": M, "input": TEXTS[0]})
    assert status == 200 and reply["usage"]["prompt_tokens"] > 0, reply
    assert_matches(sdk(pooling_cluster).embeddings.create(model=M, input=TEXTS[:2]),
                   reference(model_dir, TEXTS[:2], "LAST"))
    assert is_idle_and_whole(pooling_cluster.wait_idle())


def test_mean_pooling_of_a_random_model_equals_transformers(tmp_path_factory, mean_model):
    model = ["--model", str(mean_model)]
    cluster = start(tmp_path_factory, "pool-mean", [*model, "--device", "cpu", "--max-model-len", "256"],
                    [*model, "--served-model-name", "mean-qwen3"])
    try:
        client, want = sdk(cluster), reference(mean_model, TEXTS, "MEAN")
        assert_matches(client.embeddings.create(model="mean-qwen3", input=TEXTS, encoding_format="float"), want)
        assert_matches(client.embeddings.create(model="mean-qwen3", input=TEXTS), want)   # base64, again
        assert is_idle_and_whole(cluster.wait_idle())
    finally:
        cluster.stop()
