"""Qwen2.5-VL through the real cluster (gateway, scheduler, worker processes) with the openai SDK and a data: URL:
greedy text equals transformers' generate on the same image, with a 16-token step budget (the image's placeholder
range is prefilled over several chunks), cold and again (a prefix-cache hit on the repeated image)."""

from __future__ import annotations

import base64

import openai
import pytest
import torch
from transformers import AutoTokenizer

from steploop.common.model_path import default_model_dir
from tests.integration.cluster import Cluster
from tests.vlm.vlm_models import build_qwen2_5_vl, load_oracle, png_bytes, processed

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_qwen2_5_vl(tmp_path_factory.mktemp("vlm"), tokenizer_dir=default_model_dir())
    model = ["--model", str(path)]
    cluster = Cluster(tmp_path_factory.mktemp("cluster"),
                      scheduler_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "4",
                                      "--max-num-encoder-input-tokens", "64"],
                      worker_args=[*model, "--device", "cpu", "--max-model-len", "256"],
                      gateway_args=[*model, "--served-model-name", "vlm"], num_kv_blocks=128)
    try:
        yield cluster.start(), path
    finally:
        cluster.stop()


def oracle_text(path, text: str, png: bytes) -> str:
    """transformers: the same template, the placeholder expanded as Qwen2-VL's processor does, generate."""
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}],
                                  add_generation_prompt=True, tokenize=True)
    pixels, grid = processed(png)
    image = tok.convert_tokens_to_ids("<|image_pad|>")
    at = ids.index(image)
    ids = ids[:at] + [image] * (grid[0] * grid[1] * grid[2] // 4) + ids[at + 1:]
    with torch.no_grad():
        out = load_oracle(path).generate(torch.tensor([ids]), pixel_values=torch.from_numpy(pixels),
                                         image_grid_thw=torch.tensor([grid]), max_new_tokens=MAX_TOKENS,
                                         do_sample=False, pad_token_id=0)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_openai_sdk_data_url_equals_transformers(served):
    cluster, path = served
    png = png_bytes(112, 84, 5)
    want = oracle_text(path, "Describe", png)
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    cached = []
    for attempt in ("cold", "repeated image"):
        resp = client.chat.completions.create(model="vlm", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert resp.choices[0].message.content == want, attempt
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] > 0          # the repeated image's blocks were found in the prefix cache
