"""Sampler on synthetic logits: masks, greedy, seeded determinism independent of the batch."""

from __future__ import annotations

import math

import torch

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.penalties import PenaltyInputs, apply_penalties
from steploop.gpu_worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
)

INF = float("-inf")


def meta(params, index=None, vocab=6):
    return SamplingMetadata.from_rows(params, index or [0] * len(params), vocab, torch.device("cpu"))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isinf(out).tolist() == [[True, False, True, False, True, True]]
    assert out[0, 1] == 5.0 and out[0, 3] == 4.0


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_k_top_p(probs.log(), None, torch.tensor([0.7]))
    assert (~torch.isinf(out)).tolist() == [[True, True, False, False]]
    out = apply_top_k_top_p(probs.log(), None, torch.tensor([0.1]))     # the top token always survives
    assert (~torch.isinf(out)).tolist() == [[True, False, False, False]]


def test_min_p_relative_to_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.35]))                # threshold 0.175
    assert (~torch.isinf(out)).tolist() == [[True, True, False, False]]


def test_greedy_is_argmax_and_mixed_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(),
              SamplingParams(temperature=0.5, top_p=1e-6)]
    out = Sampler()(logits, meta(params, vocab=50))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()        # top_k=1 / tiny top_p are greedy too
    assert out.logprobs is None


def test_seeded_rows_independent_of_batch():
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 1000, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(seed=s)(row, meta([seeded], [i], 1000)).token_ids.item() for i, s in enumerate(range(20))]
    others = torch.randn(3, 1000, generator=gen)
    batch = torch.cat([others[:2], row, others[2:]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, seed=9), seeded, SamplingParams()]
    in_batch = [Sampler(seed=100 + i)(batch, meta(params, [0, 0, i, 0], 1000)).token_ids[2].item()
                for i in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 3                                        # output index changes the draw


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    out = Sampler(seed=3)(logits, meta([SamplingParams(temperature=1.0)] * 4000, vocab=3)).token_ids
    freq = torch.bincount(out, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_logprobs_are_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = Sampler()(logits, meta([SamplingParams(temperature=0.3, logprobs=2)], vocab=4))
    ref = logits.log_softmax(-1)
    assert math.isclose(out.logprobs[0].item(), ref[0, out.token_ids[0]].item(), rel_tol=1e-6)
    assert out.top_token_ids[0].tolist() == [0, 1]


def test_penalties():
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0)]
    pen = PenaltyInputs.build(params, [[3]], [[0, 0, 1]], 4, torch.device("cpu"))
    out = apply_penalties(torch.tensor([[2.0, -2.0, 1.0, 4.0]]), pen)
    # token 0: 2/2 - 0.5*2 - 1 = -1; token 1: -2*2 - 0.5 - 1 = -5.5; token 2 untouched; token 3 (prompt): 4/2
    assert out.tolist() == [[-1.0, -5.5, 1.0, 2.0]]
    assert PenaltyInputs.build([SamplingParams()], [[1]], [[2]], 4, torch.device("cpu")) is None
