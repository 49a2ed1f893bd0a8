"""Gemma 3 with images through the real cluster (gateway, scheduler, worker processes) with the openai SDK and a
data: URL: greedy text equals transformers' generate on Gemma3Processor's inputs (token_type_ids included), with a
step budget smaller than the prompt (chunks stop before the image and take it whole), cold and again (a
prefix-cache hit on the repeated image)."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from steploop.common.model_path import default_model_dir
from tests.integration.cluster import Cluster
from tests.vlm.gemma3_models import build_gemma3, gemma3_processor, load_oracle, png_bytes

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_gemma3(tmp_path_factory.mktemp("gemma3"), tokenizer_dir=default_model_dir())
    model = ["--model", str(path)]
    cluster = Cluster(tmp_path_factory.mktemp("cluster"),
                      scheduler_args=["--max-num-batched-tokens", "24", "--max-num-seqs", "4"],
                      worker_args=[*model, "--device", "cpu", "--max-model-len", "256"],
                      gateway_args=[*model, "--served-model-name", "gemma3"], num_kv_blocks=128)
    try:
        yield cluster.start(), path
    finally:
        cluster.stop()


def oracle_text(path, text: str, png: bytes) -> tuple[str, int]:
    """(transformers' greedy text, prompt length): Gemma3Processor on the rendered template, then generate."""
    from PIL import Image
    processor = gemma3_processor(path)
    content = [{"type": "text", "text": text}, {"type": "image"}]
    rendered = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                       add_generation_prompt=True)
    inputs = processor(text=rendered, images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt",
                       add_special_tokens=False, return_mm_token_type_ids=True)
    with torch.no_grad():
        out = load_oracle(path).generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, n:], skip_special_tokens=True), n


def test_openai_sdk_data_url_equals_transformers(served):
    cluster, path = served
    png = png_bytes(40, 30, 5)
    want, prompt_len = oracle_text(path, "Describe this picture please", png)
    assert want and prompt_len > 24               # the prompt takes more than one step
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe this picture please"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    cached = []
    for attempt in ("cold", "repeated image"):
        resp = client.chat.completions.create(model="gemma3", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0)
        assert resp.choices[0].message.content == want, attempt
        assert resp.usage.prompt_tokens == prompt_len
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] > 0          # the repeated image's blocks were found in the prefix cache
