"""An RL-style loop through the real cluster (scheduler, worker, gateway processes): generate, pause, update the
weights from a second checkpoint on disk, resume, generate again: each output equals transformers on the weights
served at the time. Checkpoints of another architecture, or with a tensor of another shape, are refused with a
400 and the weights before keep serving."""

from __future__ import annotations

import dataclasses
import json
import shutil
import urllib.request

import pytest
import torch

from tests.integration.cluster import Cluster
from tests.tp.tp_cluster import TpCluster
from tests.worker.family_models import TOKENIZER_FILES, load_oracle

pytestmark = pytest.mark.slow

ADMIN = "admin-key"
NAME = "tiny"
MAX_TOKENS = 8
SHAPE = {"vocab_size": 49152, "max_position_embeddings": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2}


def _checkpoint(out, tokenizer_dir, seed: int, **changes):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **changes})).to(torch.float32)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def _greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _admin(cluster: Cluster, path: str, body=None) -> tuple[int, dict]:
    return cluster.post(path, body or {}, headers={"Authorization": f"Bearer {ADMIN}"})


def _generate(cluster: Cluster, prompt: list[int]) -> tuple[list[int], str]:
    req = urllib.request.Request(cluster.base_url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "logprobs": 0, "ignore_eos": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = json.loads(resp.read())
        version = resp.headers.get("x-steploop-weight-version", "")
    return body["choices"][0]["logprobs"]["tokens"], version


def _start(tmp_path_factory, model, tp: int) -> Cluster:
    worker = ["--device", "cpu", "--max-model-len", "256"]
    gateway = ["--served-model-name", NAME, "--admin-api-key", ADMIN]
    if tp == 1:
        cluster = Cluster(tmp_path_factory.mktemp("cluster"), worker_args=["--model", str(model), *worker],
                          gateway_args=["--model", str(model), *gateway], num_kv_blocks=64)
    else:       # every rank loads its shard of the new checkpoint; the group switches on all of them or none
        cluster = TpCluster(tmp_path_factory.mktemp("tp-cluster"), tp, model=str(model), worker_args=worker,
                            num_kv_blocks=64)
        cluster.argv["gateway"] += gateway
    return cluster.start()


@pytest.mark.parametrize("tp", [1, 2])
def test_update_weights_from_disk_serves_the_new_checkpoint(tmp_path_factory, model_dir, tp):
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("ckpts")
    first = _checkpoint(root / "step-0", model_dir, seed=0)
    second = _checkpoint(root / "step-1", model_dir, seed=1)
    other = _checkpoint(root / "wider", model_dir, seed=2, intermediate_size=192)
    bad_tensor = root / "bad-tensor"          # the served config.json, a tensor of another shape
    shutil.copytree(other, bad_tensor)
    shutil.copy(first / "config.json", bad_tensor / "config.json")
    tok = AutoTokenizer.from_pretrained(first)
    cluster = _start(tmp_path_factory, first, tp)
    try:
        prompt = torch.randint(3, 49152, (20,), generator=torch.Generator().manual_seed(5)).tolist()
        decode = lambda ids: [tok.decode([t]) for t in ids]     # the API's logprobs tokens, one text each
        want_first = decode(_greedy(load_oracle(first), prompt))
        assert _generate(cluster, prompt)[0] == want_first
        assert _admin(cluster, "/pause?mode=keep")[0] == 200
        status, body = _admin(cluster, "/update_weights_from_disk", {"model_path": str(second),
                                                                     "weight_version": "step-1"})
        assert status == 200 and body["weight_version"] == "step-1", body
        assert _admin(cluster, "/resume")[0] == 200
        want_second = decode(_greedy(load_oracle(second), prompt))
        assert want_second != want_first
        assert _generate(cluster, prompt) == (want_second, "step-1")   # prefix cache cleared: no stale KV reused
        for path, words in ((other, "not the served architecture"), (bad_tensor, "checkpoint shape")):
            status, body = _admin(cluster, "/update_weights_from_disk", {"model_path": str(path)})
            assert status == 400 and words in body["error"]["message"], body
            assert _generate(cluster, prompt)[0] == want_second
        status, body = cluster.post("/update_weights_from_disk", {"model_path": str(second)})
        assert status == 401
        with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=30) as resp:
            lines = [ln for ln in resp.read().decode().splitlines() if ln.startswith("steploop:weight_updates_total")]
        assert lines and lines[0].endswith(" 1.0"), lines
    finally:
        cluster.stop()


@pytest.mark.parametrize("tp", [1, 2])
def test_update_weights_from_distributed_checks_every_bucket(tmp_path_factory, model_dir, tp):
    """A trainer (this test process, rank 0 of a gloo group) broadcasts the second checkpoint's tensors in buckets:
    one bucket with a wrong sha256 refuses the whole update (the first weights keep serving); then the real
    update serves the second checkpoint, equal to transformers on it."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from steploop.weight_sync import WeightSender, make_buckets
    root = tmp_path_factory.mktemp("dist-ckpts")
    first = _checkpoint(root / "step-0", model_dir, seed=0)
    second = _checkpoint(root / "step-1", model_dir, seed=1)
    tok = AutoTokenizer.from_pretrained(first)
    cluster = _start(tmp_path_factory, first, tp)
    try:
        prompt = torch.randint(3, 49152, (20,), generator=torch.Generator().manual_seed(6)).tolist()
        decode = lambda ids: [tok.decode([t]) for t in ids]
        want_first = decode(_greedy(load_oracle(first), prompt))
        want_second = decode(_greedy(load_oracle(second), prompt))
        sender = WeightSender(cluster.base_url, ADMIN, timeout_s=60)
        sender.init_group(world_size=1 + tp)
        state = load_file(str(second / "model.safetensors"))
        buckets = make_buckets(state, max_bytes=16 << 20)
        assert len(buckets) >= 3
        corrupt = list(buckets)
        corrupt[1] = dataclasses.replace(buckets[1], sha256="0" * 64)
        status, body = sender.update(buckets=corrupt, weight_version="bad")
        assert status == 400 and "sha256" in body["error"]["message"], body
        assert _generate(cluster, prompt)[0] == want_first
        status, body = sender.update(state, weight_version="rl-1")
        assert status == 200 and body["weight_version"] == "rl-1", body
        assert _generate(cluster, prompt) == (want_second, "rl-1")
    finally:
        cluster.stop()
