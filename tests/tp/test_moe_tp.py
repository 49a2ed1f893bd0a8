"""Mixture-of-experts models across 2 ranks (separate processes, gloo on loopback), exact against transformers on
the same weights: random Mixtral, Qwen2-MoE (shared expert, dense layers between) and Qwen3-MoE (per-head q/k
norm, a replicated KV head) from transformers' config classes, sharded (every expert split by rows / columns) and
expert parallel (each rank holding half the experts whole). Greedy tokens equal transformers' generate and every
logprob is within 1e-4, with whole prompts, uneven prefill chunks and a preemption (tests/worker/test_families.py's
schedules), and both ranks sample the same tokens."""

from __future__ import annotations

import pytest

from tests.tp.moe_ranks import SCHEDULES, run_rank_processes
from tests.worker.family_models import build_family_model, load_oracle
from tests.worker.test_families import oracle, prompts

pytestmark = pytest.mark.slow      # 3 families x 2 modes, each 2 spawned ranks: about 2 min on 2 shared cores

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def moe_family(request, tmp_path_factory, model_dir):
    path = build_family_model(request.param, tmp_path_factory.mktemp(request.param), model_dir)
    hf_model = load_oracle(path)
    return request.param, path, [oracle(hf_model, p) for p in prompts()]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
def test_moe_tp2_equals_transformers(moe_family, expert_parallel):
    name, path, expected = moe_family
    ranks = run_rank_processes(path, 2, expert_parallel)
    for (chunk, preempt), got0, got1 in zip(SCHEDULES, *ranks):
        where = f"{name} chunk {chunk} preempt {preempt}"
        assert [t for t, _ in got0.values()] == [t for t, _ in got1.values()], f"{where}: the ranks differ"
        for handle, (want_tokens, want_logprobs) in enumerate(expected):
            tokens, logprobs = got0[handle]
            assert tokens == want_tokens, f"{where} prompt {handle}: {tokens} != {want_tokens}"
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{where} prompt {handle}"
