"""Two families through the real cluster (scheduler, worker, gateway processes) with the openai SDK: greedy text and
logprobs equal transformers' generate, on prompts longer than the sliding window, with a 16-token step budget (every
prompt chunked) and a repeated prompt (a prefix-cache hit)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.integration.cluster import Cluster
from tests.worker.family_models import build_family_model, load_oracle

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPT_LENS = (45, 66)


@pytest.fixture(scope="module", params=["gemma2", "qwen2_window"])
def served(request, tmp_path_factory, model_dir):
    path = build_family_model(request.param, tmp_path_factory.mktemp(request.param), model_dir)
    model = ["--model", str(path)]
    cluster = Cluster(tmp_path_factory.mktemp("cluster"),
                      scheduler_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "16"],
                      worker_args=[*model, "--device", "cpu", "--max-model-len", "256"],
                      gateway_args=[*model, "--served-model-name", request.param],
                      num_kv_blocks=128)
    try:
        yield request.param, cluster.start(), load_oracle(path), AutoTokenizer.from_pretrained(path)
    finally:
        cluster.stop()


def oracle(hf_model, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]


def test_greedy_text_and_logprobs_equal_transformers(served):
    name, cluster, hf_model, tok = served
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    gen = torch.Generator().manual_seed(3)
    for n in PROMPT_LENS:
        prompt = torch.randint(3, 49152, (n,), generator=gen).tolist()
        want_tokens, want_logprobs = oracle(hf_model, prompt)
        for attempt in ("cold", "prefix-cache hit"):
            resp = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             logprobs=0)
            choice = resp.choices[0]
            assert choice.text == tok.decode(want_tokens), f"{name} {n} tokens, {attempt}"
            assert choice.logprobs.token_logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{name} {attempt}"
