"""The sharded forward (Megatron split, gloo all-reduces) against transformers on the same weights: N ranks of
ModelRunner in threads of one process, over a real gloo group on loopback."""

from __future__ import annotations

import pytest
import torch

from tests.tp.tp_models import run_ranks

PROMPTS = [[1, 510, 1250, 282, 3224, 314, 30, 2438, 28, 1024], [1, 17, 42, 4000, 9000, 123],
           list(range(100, 140))]   # the last crosses two blocks and several chunks


def hf_greedy(model_dir, prompt, max_tokens):
    from tests.worker.family_models import load_oracle
    model = load_oracle(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fixture", ["tp2_model_dir", "tp2_replicated_kv_dir"])
def test_tp2_greedy_equals_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    outputs = run_ranks(model_dir, 2, PROMPTS, max_tokens=8)
    assert outputs[0] == outputs[1], "the ranks sampled different tokens"
    for handle, prompt in enumerate(PROMPTS):
        assert outputs[0][handle] == hf_greedy(model_dir, prompt, 8), f"prompt {handle}"


def test_tp1_and_tp2_agree(tp2_model_dir):
    assert run_ranks(tp2_model_dir, 1, PROMPTS, 6)[0] == run_ranks(tp2_model_dir, 2, PROMPTS, 6)[0]
