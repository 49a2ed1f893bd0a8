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


@pytest.mark.parametrize("tied", [False, True])
def test_tp2_bf16_checkpoint_stays_16_bit_and_equals_transformers(tmp_path, model_dir, tied):
    """A bf16 checkpoint at -tp 2: each rank keeps its share of every linear and of the embedding table at 16 bits
    (model/half_weights.py, cut by the sharder before packing; tied: its head shares the table's rows), and the
    tokens are transformers' fp32 on the upcast weights."""
    from steploop.gpu_worker.cpu_kernels.packed_weights import BF16
    from steploop.gpu_worker.model.packed_linear_layer import PackedLinear
    from tests.tp.tp_models import build_llama
    path = build_llama(tmp_path, model_dir, num_heads=4, num_kv_heads=2, tied=tied, dtype=torch.bfloat16)
    runners: list = []
    outputs = run_ranks(path, 2, PROMPTS, max_tokens=8, runners=runners)
    assert outputs[0] == outputs[1]
    for runner in runners:
        kinds = [m.packed.kind for m in runner.model.modules() if isinstance(m, PackedLinear) and m.packed is not None]
        assert kinds.count(BF16) == 4 * 2 + 1, kinds          # 2 layers' 4 linears and the lm_head share
        table = runner.model.model.embed_tokens.inner
        assert table.packed.out_features == runner.model.lm_head.inner.out_features
        assert (runner.model.lm_head.inner.packed is table.packed) == tied
    for handle, prompt in enumerate(PROMPTS):
        assert outputs[0][handle] == hf_greedy(path, prompt, 8), f"prompt {handle}"
