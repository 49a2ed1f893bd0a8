"""Pipeline stages (-pp 2, and -tp 2 -pp 2) against transformers on the same weights: every rank a ModelRunner in
its own thread over real gloo groups, driven by one plan stream as the scheduler drives a group (pp_ranks.py).
Greedy tokens equal transformers' generate and every logprob is within 1e-4, with whole prompts, uneven prefill
chunks and a preemption (tests/worker/test_families.py's schedules), for a dense Llama (untied; tied, so the last
stage holds the embedding for its head) and a mixture of experts (Mixtral); each stage holds only its layers."""

from __future__ import annotations

import pytest

from steploop.gpu_worker.distributed.pipeline import stage_layers
from steploop.gpu_worker.model.half_weights import HalfEmbedding
from steploop.gpu_worker.model.packed_linear_layer import PackedLinear
from tests.pp.pp_ranks import PipelineGroup
from tests.tp.moe_ranks import SCHEDULES
from tests.worker.family_models import load_oracle
from tests.worker.test_families import serve

CASES = [("llama", 1, 2), ("llama_tied", 1, 2), ("llama", 2, 2), ("llama_bf16", 2, 2), ("mixtral", 1, 2),
         ("mixtral", 2, 2), ("qwen3_moe", 2, 2)]   # 3 layers: 2 + 1, a dense layer between sparse ones, a replicated KV head


# the first case runs in the fast suite; the others (about 10 s each on 2 shared cores) are slow
PARAMS = [pytest.param(*case, id=f"{case[0]}-tp{case[1]}-pp{case[2]}", marks=[pytest.mark.slow] if i else [])
          for i, case in enumerate(CASES)]


@pytest.mark.parametrize("name, tp, pp", PARAMS)
def test_stages_equal_transformers(models, name, tp, pp):
    path, expected = models(name)
    group = PipelineGroup(path, tp, pp)
    try:
        total = load_oracle(path).config.num_hidden_layers
        for r in group.runners:          # each stage builds, loads and caches its own layers only
            first, end = stage_layers(total, pp)[r.pipe.share.stage]
            assert [layer.self_attn.layer_idx for layer in r.model.model.layers] == list(range(first, end))
            assert len(r.kv_caches) == end - first
            assert (r.model.lm_head is None) == (r.pipe.share.stage < pp - 1)
            if name.endswith("bf16"):    # every linear of the stage's share at 16 bits, its table share too
                held = [m for m in r.model.modules() if isinstance(m, PackedLinear) and m.packed is not None]
                assert len(held) == 4 * (end - first) + (r.model.lm_head is not None)
                assert any(isinstance(m, HalfEmbedding) for m in r.model.modules()) == (r.pipe.share.stage == 0)
        for chunk, preempt in SCHEDULES:
            got = serve(group, chunk, preempt)
            for handle, (want_tokens, want_logprobs) in enumerate(expected):
                tokens, logprobs = got[handle]
                where = f"{name} -tp {tp} -pp {pp} chunk {chunk} preempt {preempt} prompt {handle}"
                assert tokens == want_tokens, f"{where}: {tokens} != {want_tokens}"
                assert logprobs == pytest.approx(want_logprobs, abs=1e-4), where
    finally:
        group.close()
