"""Multi-LoRA serving through the openai SDK against a real cluster (three processes, real gRPC and HTTP):
greedy text equals transformers + peft per adapter, alone and mixed with base requests 16 at once; runtime
load / unload / reload while other requests stream; 404 while unloaded; per-adapter prefix caching; bad adapters
refused with a 4xx naming the problem while the engine keeps serving; /v1/models and vllm:lora_requests_info."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request

import openai
import pytest

from tests.integration.cluster import MODEL, Cluster, assert_healthy_and_no_leak

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "List three colors:",
           "def fibonacci(n):"]


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory, adapter_dirs):
    modules = [f"{name}={path}" for name, path in adapter_dirs.items()]
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "3",
            "--lora-modules", *modules]
    c = Cluster(tmp_path_factory.mktemp("lora-cluster"), scheduler_args=lora, worker_args=lora,
                gateway_args=["--enable-lora", "--allow-runtime-lora-updating"])
    try:
        yield c.start()
    finally:
        c.stop()


def post(cluster, path: str, body: dict) -> tuple[int, dict | str]:
    """The adapter routes answer success in plain text (as vLLM's do) and errors in OpenAI's JSON shape."""
    req = urllib.request.Request(cluster.base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw.decode()


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def aclient(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def expected(peft_ref, adapter, prompt, max_tokens=MAX_TOKENS) -> str:
    return peft_ref.greedy_text(adapter, peft_ref.tokenizer(prompt).input_ids, max_tokens)


@pytest.mark.parametrize("adapter", ["attn8", "mlp16"])
def test_each_adapter_equals_transformers_peft(lora_cluster, peft_ref, adapter):
    api = client(lora_cluster)
    texts = []
    for prompt in PROMPTS[:2]:
        resp = api.completions.create(model=adapter, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
        assert resp.model == adapter
        assert resp.choices[0].text == expected(peft_ref, adapter, prompt)
        texts.append(resp.choices[0].text)
    assert texts != [expected(peft_ref, None, p) for p in PROMPTS[:2]], "the adapter changed nothing"


def test_sixteen_mixed_requests_at_once_equal_transformers_peft(lora_cluster, peft_ref):
    names = [MODEL, "attn8", "mlp16", MODEL] * 4
    cases = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate(names)]

    async def run():
        api = aclient(lora_cluster)
        return await asyncio.gather(*(api.completions.create(model=name, prompt=prompt, temperature=0,
                                                             max_tokens=MAX_TOKENS) for name, prompt in cases))
    for (name, prompt), resp in zip(cases, asyncio.run(run())):
        adapter = None if name == MODEL else name
        assert resp.choices[0].text == expected(peft_ref, adapter, prompt), (name, prompt)


def test_models_lists_adapters_with_the_base_as_parent(lora_cluster, adapter_dirs):
    cards = {m.id: m for m in client(lora_cluster).models.list().data}
    assert set(cards) >= {MODEL, "attn8", "mlp16"}
    assert cards["attn8"].parent == MODEL and cards["attn8"].root == str(adapter_dirs["attn8"])
    assert client(lora_cluster).models.retrieve("mlp16").parent == MODEL


def test_an_unknown_adapter_is_404_in_openai_shape(lora_cluster):
    with pytest.raises(openai.NotFoundError) as err:
        client(lora_cluster).completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "nope" in err.value.body["message"]


def test_load_use_unload_reload_while_others_stream(lora_cluster, peft_ref, adapter_dirs, tmp_path):
    copy = shutil.copytree(adapter_dirs["mlp16"], tmp_path / "copy")

    async def run():
        api = aclient(lora_cluster)
        firsts = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(stream_text(api, name, first))
                   for name, first in zip((MODEL, "attn8", MODEL), firsts)]
        await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), 300)   # all three streaming
        status, text = await asyncio.to_thread(post, lora_cluster, "/v1/load_lora_adapter",
                                               {"lora_name": "late", "lora_path": str(copy)})
        assert status == 200 and "added successfully" in text
        used = await api.completions.create(model="late", prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS)
        status, text = await asyncio.to_thread(post, lora_cluster, "/v1/unload_lora_adapter", {"lora_name": "late"})
        assert status == 200 and "removed successfully" in text
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="late", prompt=PROMPTS[0], max_tokens=2)
        status, _ = await asyncio.to_thread(post, lora_cluster, "/v1/load_lora_adapter",
                                            {"lora_name": "late", "lora_path": str(copy)})
        assert status == 200
        again = await api.completions.create(model="late", prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS)
        return used, again, await asyncio.gather(*streams)

    async def stream_text(api, name, first: asyncio.Event):
        stream = await api.completions.create(model=name, prompt=PROMPTS[1], temperature=0, max_tokens=48,
                                              stream=True)
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                first.set()
        first.set()                      # an empty stream must not leave the test waiting
        return name, text

    used, again, streamed = asyncio.run(run())
    assert used.choices[0].text == again.choices[0].text == expected(peft_ref, "mlp16", PROMPTS[0])
    for name, text in streamed:
        assert text == expected(peft_ref, None if name == MODEL else name, PROMPTS[1], 48)
    assert post(lora_cluster, "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200


def test_a_shared_prefix_is_computed_once_per_adapter(lora_cluster):
    prefix = "Here is a long shared instruction that every request repeats word for word. " * 6
    api = client(lora_cluster)
    cached = {}
    for i, name in enumerate(["attn8", "attn8", "mlp16", "mlp16", MODEL]):
        resp = api.completions.create(model=name, prompt=prefix + f"Question {i}:", temperature=0, max_tokens=2)
        cached[i] = resp.usage.prompt_tokens_details.cached_tokens
    assert cached[0] == 0 and cached[1] > 32          # the second request of an adapter hits its first's blocks
    assert cached[2] == 0 and cached[3] > 32          # another adapter computes the prefix itself, once
    assert cached[4] == 0                             # and so does the base model


def test_bad_adapters_are_4xx_naming_the_problem_and_the_engine_still_serves(lora_cluster, adapter_dirs, tmp_path):
    wide = shutil.copytree(adapter_dirs["mlp16"], tmp_path / "wide")
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    broken = shutil.copytree(adapter_dirs["attn8"], tmp_path / "broken")
    (broken / "adapter_config.json").write_text("{ not json")
    other = make_mismatched(adapter_dirs["attn8"], tmp_path / "other")
    cases = [({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 404, "does not exist"),
             ({"lora_name": "x", "lora_path": str(wide)}, 400, "greater than max_lora_rank 16"),
             ({"lora_name": "x", "lora_path": str(broken)}, 400, "malformed"),
             ({"lora_name": "x", "lora_path": str(other)}, 400, "another base model"),
             ({"lora_name": "attn8", "lora_path": str(adapter_dirs["attn8"])}, 400, "already been loaded"),
             ({"lora_name": "x"}, 400, "lora_path")]
    for body, status, words in cases:
        got, answer = post(lora_cluster, "/v1/load_lora_adapter", body)
        assert got == status and words in answer["error"]["message"], (body, got, answer)
    got, answer = post(lora_cluster, "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert got == 404 and "cannot be found" in answer["error"]["message"]
    assert_healthy_and_no_leak(lora_cluster)


def test_lora_requests_info_metric(lora_cluster):
    client(lora_cluster).completions.create(model="attn8", prompt="Hi", max_tokens=2)
    text = urllib.request.urlopen(lora_cluster.base_url + "/metrics", timeout=30).read().decode()
    lines = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert lines and 'max_lora="2"' in lines[0] and "running_lora_adapters=" in lines[0]


def test_runtime_updates_are_404_unless_allowed(tmp_path_factory, adapter_dirs):
    c = Cluster(tmp_path_factory.mktemp("lora-fixed"), scheduler_args=["--enable-lora"],
                worker_args=["--enable-lora"], gateway_args=["--enable-lora"])
    try:
        c.start()
        got, _ = post(c, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter_dirs["attn8"])})
        assert got == 404
    finally:
        c.stop()


def make_mismatched(source, folder):
    """The adapter with its q_proj A matrices one column wider: trained for another hidden size."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors = {k: torch.cat([v, v[:, :1]], dim=1) if "q_proj.lora_A" in k else v for k, v in tensors.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
