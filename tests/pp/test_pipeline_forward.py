"""Pipeline stages (-pp 2, and -tp 2 -pp 2) against transformers on the same weights: every rank a ModelRunner in
its own thread over real gloo groups, driven by one plan stream as the scheduler drives a group (pp_ranks.py).
Greedy tokens equal transformers' generate and every logprob is within 1e-4, with whole prompts, uneven prefill
chunks and a preemption (tests/worker/test_families.py's schedules), for a dense Llama (untied; tied, so the last
stage holds the embedding for its head) and a mixture of experts (Mixtral); each stage holds only its layers."""

from __future__ import annotations

import pytest

from tests.pp.pp_ranks import PipelineGroup
from tests.tp.moe_ranks import SCHEDULES
from tests.worker.family_models import build_family_model, load_oracle
from tests.worker.test_families import oracle, prompts, serve

CASES = [("llama", 1, 2), ("llama_tied", 1, 2), ("llama", 2, 2), ("mixtral", 1, 2), ("mixtral", 2, 2)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dir):
    from tests.tp.tp_models import build_llama
    built = {"llama": build_llama(tmp_path_factory.mktemp("pp-llama"), model_dir, 4, 2, tied=False),
             "llama_tied": build_llama(tmp_path_factory.mktemp("pp-tied"), model_dir, 4, 1, tied=True),
             "mixtral": build_family_model("mixtral", tmp_path_factory.mktemp("pp-mixtral"), model_dir)}
    expected = {}
    for name, path in built.items():
        hf_model = load_oracle(path)
        expected[name] = [oracle(hf_model, p) for p in prompts()]
    return built, expected


@pytest.mark.parametrize("name, tp, pp", CASES, ids=[f"{n}-tp{t}-pp{p}" for n, t, p in CASES])
def test_stages_equal_transformers(models, name, tp, pp):
    built, expected = models
    group = PipelineGroup(built[name], tp, pp)
    try:
        layers = [sum(1 for _ in r.model.model.layers) for r in group.runners]
        assert sum(layers[::tp]) == 2 and all(n == 1 for n in layers), layers   # each stage: its own layer
        assert all((r.model.lm_head is None) == (r.pipe.share.stage == 0) for r in group.runners)
        assert all(len(r.kv_caches) == 1 for r in group.runners)
        for chunk, preempt in SCHEDULES:
            got = serve(group, chunk, preempt)
            for handle, (want_tokens, want_logprobs) in enumerate(expected[name]):
                tokens, logprobs = got[handle]
                where = f"{name} -tp {tp} -pp {pp} chunk {chunk} preempt {preempt} prompt {handle}"
                assert tokens == want_tokens, f"{where}: {tokens} != {want_tokens}"
                assert logprobs == pytest.approx(want_logprobs, abs=1e-4), where
    finally:
        group.close()
