"""Generation through ModelRunner equals transformers' greedy generate, whatever the chunking, batch mix,
preemption or async feeding; seeded sampling gives the same tokens alone, in a batch and after preemption."""

from __future__ import annotations

import pytest
import torch

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import CachedRequestData, NewRequestData, StepPlan
from tests.worker.driver import Driver

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts) -> list[list[int]]:
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)
        outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("chunk", [3, 16, {0: 1, 1: 5, 2: 64}])
def test_greedy_matches_transformers(fresh_runner, prompts, hf_greedy, chunk):
    driver = Driver(fresh_runner)
    for h, ids in enumerate(prompts):
        driver.add(h, ids, MAX_TOKENS)
    outputs = driver.run(chunk)
    assert [outputs[h] for h in range(len(prompts))] == hf_greedy


def test_greedy_with_preemption_and_late_arrival(fresh_runner, prompts, hf_greedy):
    driver = Driver(fresh_runner)
    driver.add(0, prompts[0], MAX_TOKENS)
    driver.add(1, prompts[1], MAX_TOKENS)
    for _ in range(4):
        driver.step(4)
    driver.preempt(1)                         # recompute from scratch, outputs so far kept
    driver.add(2, prompts[2], MAX_TOKENS)     # arrives mid-flight
    outputs = driver.run(5)
    assert [outputs[h] for h in range(3)] == hf_greedy


def test_async_feeds_own_token(fresh_runner, prompts, hf_greedy):
    """Plans that never carry the sampled tokens: the worker feeds step N's token into step N+1."""
    ids = prompts[0]
    blocks = [1, 2, 3]
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(5, ids, [], SamplingParams(), blocks, 0)],
                    scheduled_handles=[5], num_scheduled_tokens=[len(ids)])
    tokens = fresh_runner.execute(plan).sampled[5]
    for step in range(1, MAX_TOKENS):
        cached = CachedRequestData()
        cached.append(5, len(ids) + step - 1, [])
        result = fresh_runner.execute(StepPlan(step_id=step, cached=cached, scheduled_handles=[5],
                                               num_scheduled_tokens=[1]))
        tokens += result.sampled[5]
    assert tokens == hf_greedy[0]


def _seeded_run(runner, prompts, with_others: bool, preempt_at: int | None) -> list[int]:
    driver = Driver(runner)
    driver.add(0, prompts[0], MAX_TOKENS, SamplingParams(temperature=1.0, top_p=0.9, seed=1234))
    if with_others:
        driver.add(1, prompts[1], MAX_TOKENS, SamplingParams(temperature=1.0))
        driver.add(2, prompts[2], MAX_TOKENS, SamplingParams(temperature=0.7, top_k=5, seed=7))
    for i in range(200):
        if 0 in driver.outputs:
            break
        if i == preempt_at:
            driver.preempt(0)
        driver.step(4 if with_others else 64)
    return driver.outputs[0]


def test_seeded_sampling_independent_of_batch_and_preemption(fresh_runner, prompts):
    alone = _seeded_run(fresh_runner, prompts, with_others=False, preempt_at=None)
    fresh_runner.reset()
    mixed = _seeded_run(fresh_runner, prompts, with_others=True, preempt_at=5)
    assert alone == mixed


SEEDED_PENALISED = SamplingParams(temperature=0.9, top_k=40, seed=99, presence_penalty=0.5, frequency_penalty=0.3,
                                  repetition_penalty=1.2)


@pytest.mark.parametrize("k", [1, 6])
def test_seeded_sampling_resumes_exactly_from_delivered_tokens(fresh_runner, prompts, k):
    """A migrated request arrives with k outputs another worker sampled: the rest is what the undisturbed run
    gave, penalties counting the k (the seed is per output position, not a generator's state)."""
    driver = Driver(fresh_runner)
    driver.add(0, prompts[1], MAX_TOKENS, SEEDED_PENALISED)
    full = driver.run(4)[0]
    fresh_runner.reset()
    driver = Driver(fresh_runner)
    driver.add(1, prompts[0], MAX_TOKENS, SamplingParams(temperature=1.0, seed=5))   # a neighbour in the batch
    driver.add(0, prompts[1], MAX_TOKENS, SEEDED_PENALISED, output=full[:k])
    assert driver.run(3)[0] == full


def test_logprobs_and_errors(fresh_runner, prompts, hf_model):
    ids = prompts[0]
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(1, ids, [], SamplingParams(logprobs=3), [1, 2], 0)],
                    scheduled_handles=[1], num_scheduled_tokens=[len(ids)])
    result = fresh_runner.execute(plan)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    lp = result.logprobs[1][0]
    assert lp.top_token_ids[0] == result.sampled[1][0] == int(ref.argmax())
    assert abs(lp.logprob - float(ref.max())) < 1e-3 and len(lp.top_logprobs) == 3
    bad = fresh_runner.execute(StepPlan(step_id=1, scheduled_handles=[99], num_scheduled_tokens=[1]))
    assert "99" in bad.error and not bad.sampled


def test_profile_forward_is_a_real_forward(fresh_runner, hf_model):
    """The CUDA memory profile's dummy forward (run here on the CPU with a short length) computes the model on its
    max-length prompt of token 0: its logits are transformers' for that prompt, and it leaves the KV cache alone."""
    from steploop.gpu_worker.model_runner import _profile_forward

    model, n = fresh_runner.model, 40
    before = [c.clone() for c in fresh_runner.kv_caches]
    logits = _profile_forward(model, model.config, 16, n, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        want = hf_model(torch.zeros(1, n, dtype=torch.long)).logits[:, -1]
    assert logits.shape == (1, model.config.vocab_size)
    torch.testing.assert_close(logits, want, atol=2e-3, rtol=1e-3)
    assert logits.argmax().item() == want.argmax().item()
    assert all(torch.equal(c, b) for c, b in zip(fresh_runner.kv_caches, before))


def test_draft_verification_greedy(fresh_runner, prompts, hf_greedy):
    """Drafts equal to the greedy continuation are all accepted (+1 bonus token); a wrong one stops acceptance."""
    ids, ref = prompts[2], hf_greedy[2]
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(1, ids, [], SamplingParams(), [1, 2, 3], 0)],
                    scheduled_handles=[1], num_scheduled_tokens=[len(ids)])
    assert fresh_runner.execute(plan).sampled[1] == ref[:1]
    cached = CachedRequestData()
    cached.append(1, len(ids), [])
    drafts = ref[1:4]
    result = fresh_runner.execute(StepPlan(step_id=1, cached=cached, scheduled_handles=[1],
                                           num_scheduled_tokens=[1 + len(drafts)], draft_token_ids={1: drafts}))
    assert result.sampled[1] == ref[1:5]
    cached = CachedRequestData()
    cached.append(1, len(ids) + 4, [])
    wrong = [ref[5], (ref[6] + 1) % 49152]              # first draft right, second wrong
    result = fresh_runner.execute(StepPlan(step_id=2, cached=cached, scheduled_handles=[1],
                                           num_scheduled_tokens=[3], draft_token_ids={1: wrong}))
    assert result.sampled[1] == ref[5:7]
    assert fresh_runner.batch[1].num_computed_tokens == len(ids) + 6
