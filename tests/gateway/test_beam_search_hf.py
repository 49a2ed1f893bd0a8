"""The beam ranking (common/beam_ranking.py, what the scheduler's beam groups run) against transformers'
generate(num_beams=...) on a tiny random Llama: the same returned sequences, in the same order, with the same
scores and cumulative logprobs, for 4 prompts x beams 2 and 4 (all W returned, best first), length penalties 1, 0
and 2 and early_stopping False / True / "never". The step function answers what the worker answers: the top K
logprobs of the next token (log_softmax of fp32 logits). tests/scheduler/test_beam_groups.py runs the same through
the scheduler's beam groups and a paged worker."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from steploop.common.beam_ranking import BeamConfig, BeamRanking
from tests.beam_model import EOS, PROMPTS, tiny_beam_llama

MAX_NEW = 7


@pytest.fixture(scope="module")
def model():
    return tiny_beam_llama()


def hf_beams(model, prompt, width, n, penalty, early):
    out = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=width, num_return_sequences=n,
                         length_penalty=penalty, early_stopping=early, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                         pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    beams = []
    for row, indices, score in zip(out.sequences, out.beam_indices, out.sequences_scores):
        length = int((indices >= 0).sum())
        tokens = row[len(prompt):len(prompt) + length].tolist()
        beams.append((tokens, score.item(), score.item() * length ** penalty))
    return beams


async def beam_search(step, config, max_tokens, stop_ids):
    """The ranking driven step by step, each step asking for every live beam's top K."""
    ranking = BeamRanking(config, max_tokens, stop_ids)
    while not ranking.done:
        ranking.step(await step([b.tokens for b in ranking.running], ranking.k))
    return ranking.finished


def engine_step(model, prompt):
    async def step(seqs, k):
        with torch.no_grad():
            out = []
            for seq in seqs:
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1].float()
                values, ids = logits.log_softmax(-1).topk(k)
                out.append(list(zip(ids.tolist(), values.tolist())))
        return out
    return step


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("penalty,early", [(1.0, False), (0.0, True), (2.0, "never")])
def test_equals_transformers(model, width, penalty, early):
    stops_seen = 0
    for prompt in PROMPTS:
        want = hf_beams(model, prompt, width, width, penalty, early)    # n = W: all of them, best first
        got = asyncio.run(beam_search(engine_step(model, prompt), BeamConfig(width, penalty, early), MAX_NEW,
                                      frozenset({EOS})))
        assert [h.tokens for h in got] == [w[0] for w in want], (prompt, width)
        for h, (tokens, score, cum) in zip(got, want):
            assert h.score == pytest.approx(score, abs=1e-4)
            assert h.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert h.cum_logprob == pytest.approx(sum(lp.logprob for lp in h.logprobs), abs=1e-4)
            assert h.finish_reason == ("stop" if tokens[-1] == EOS else "length")
            stops_seen += tokens[-1] == EOS
    if penalty <= 1.0:     # (a penalty of 2 favours long beams: none ends early here)
        assert stops_seen, "no beam ended on EOS: the test does not reach the finished-hypothesis path"


def test_early_stop_ends_before_max_tokens(model):
    """With early_stopping the search stops asking once W hypotheses are kept; the first step runs the prompt once
    (not W copies of it)."""
    early = 0
    for prompt in PROMPTS:
        calls = []
        base = engine_step(model, prompt)

        async def counting(seqs, k, base=base, calls=calls):
            calls.append(len(seqs))
            return await base(seqs, k)

        got = asyncio.run(beam_search(counting, BeamConfig(2, 1.0, True), 30, frozenset({EOS})))
        assert len(got) == 2 and calls[0] == 1
        assert np.all(np.diff([h.score for h in got]) <= 0)
        if len(calls) < 30:
            early += 1
            assert all(h.finish_reason == "stop" for h in got)
    assert early, "no prompt ended early: the test does not reach the early stop"
