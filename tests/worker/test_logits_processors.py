"""logit_bias, min_tokens bans and grammar bitmasks, batched over rows (no model needed)."""

from __future__ import annotations

import torch

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.logits_processors import LogitsEdits, apply_bitmask, apply_logits_edits
from steploop.gpu_worker.sampler import Sampler, SamplingMetadata

EOS = 2


def test_nothing_built_without_edits():
    assert LogitsEdits.build([SamplingParams(), SamplingParams()], [0, 0], (EOS,), torch.device("cpu")) is None


def test_bias_and_min_tokens_apply_per_row():
    params = [SamplingParams(logit_bias=((5, 3.0), (7, -100.0))), SamplingParams(min_tokens=2, stop_token_ids=(4,)),
              SamplingParams(min_tokens=2)]
    edits = LogitsEdits.build(params, [0, 1, 2], (EOS,), torch.device("cpu"))
    out = apply_logits_edits(torch.zeros(3, 10), edits)
    assert out[0, 5] == 3.0 and out[0, 7] == -100.0 and out[0].isfinite().all()
    assert out[1, EOS] == float("-inf") and out[1, 4] == float("-inf")
    assert out[2].isfinite().all()                      # 2 outputs already: min_tokens reached


def test_bitmask_unpacks_bits_little_endian():
    logits = torch.zeros(2, 40)
    mask = torch.full((2, 2), -1, dtype=torch.int32)
    mask[1, 0] = 0b1010                                 # row 1: only tokens 1 and 3 of the first word
    mask[1, 1] = 0
    apply_bitmask(logits, mask, [1])
    assert logits[0].isfinite().all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [1, 3]


def test_sampler_greedy_follows_logit_bias():
    params = [SamplingParams(logit_bias=((9, 50.0),))]
    edits = LogitsEdits.build(params, [0], (EOS,), torch.device("cpu"))
    meta = SamplingMetadata.from_rows(params, [0], 16, torch.device("cpu"), None, edits)
    logits = torch.randn(1, 16)
    assert Sampler()(logits, meta).token_ids.tolist() == [9]
