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


def test_bad_word_bans_follow_vllms_prefix_rule():
    from steploop.gpu_worker.logits_processors import bad_word_bans
    words = ((7,), (3, 4), (1, 2, 5))
    assert bad_word_bans(words, []) == [7]                      # longer words need their prefix first
    assert bad_word_bans(words, [9, 3]) == [7, 4]
    assert bad_word_bans(words, [3, 1, 2]) == [7, 5]
    assert bad_word_bans(words, [1, 3, 2]) == [7]               # the prefix must be the output's very end


def test_allowed_token_ids_mask_everything_else_and_beat_the_bias():
    params = [SamplingParams(allowed_token_ids=(1, 4), logit_bias=((9, 100.0), (4, 5.0))), SamplingParams(),
              SamplingParams(allowed_token_ids=(2,), bad_words=((2,),))]
    edits = LogitsEdits.build(params, [0, 0, 0], (EOS,), torch.device("cpu"), outputs=[[], [], []])
    out = apply_logits_edits(torch.zeros(3, 12), edits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 4] and out[0, 4] == 5.0
    assert out[1].isfinite().all()                              # rows that do not ask are left alone
    assert not out[2].isfinite().any()                          # allowed and banned: nothing left (as vLLM)


def test_bad_words_use_each_rows_own_output():
    params = [SamplingParams(bad_words=((3, 4),))] * 2
    edits = LogitsEdits.build(params, [1, 1], (EOS,), torch.device("cpu"), outputs=[[3], [5]])
    out = apply_logits_edits(torch.zeros(2, 8), edits)
    assert out[0, 4] == float("-inf") and out[1].isfinite().all()


def test_sampler_never_violates_the_controls_over_seeded_draws():
    """200 seeded draws from random logits with a bias pushing toward banned tokens: a reference check of the
    rules (allowed set, bad words' prefix rule) on every draw."""
    from steploop.gpu_worker.logits_processors import bad_word_bans
    gen = torch.Generator().manual_seed(0)
    vocab, allowed = 32, (1, 3, 5, 7, 11)
    bias = ((3, 30.0), (0, 30.0))                               # 3 is a bad word; 0 is not allowed
    sampler = Sampler()
    for seed in range(200):
        output = [int(torch.randint(vocab, (1,), generator=gen))]
        params = [SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=allowed, logit_bias=bias,
                                 bad_words=((3,), (output[0], 5)))]
        edits = LogitsEdits.build(params, [1], (EOS,), torch.device("cpu"), outputs=[output])
        meta = SamplingMetadata.from_rows(params, [1], vocab, torch.device("cpu"), None, edits)
        token = sampler(torch.randn(1, vocab, generator=gen) * 3, meta).token_ids.item()
        assert token in allowed and token not in bad_word_bans(params[0].bad_words, output), (seed, token)
