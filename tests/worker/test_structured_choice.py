"""guided_choice through the worker's real grammar path (structured_output.py, xgrammar, the default model's
tokenizer): the gateway's regex of escaped alternatives compiles whatever the strings hold, admits each choice
(and then the end of the output), and admits nothing else."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from steploop.common.sampling_params import SamplingParams
from steploop.gateway.openai_api.vllm_extras import choice_regex
from steploop.gpu_worker.structured_output import GrammarRefused

CHOICES = ["yes", "no", "a.b (c)|d*", "x\\y", "naïve café", "line\nbreak", "tab\tx", "[{json}]", "$^+?", "/slash",
           "-dash-", "quote\"s'", "日本語", "  spaced  "]


@pytest.fixture(scope="module")
def structured(model_dir):
    from transformers import AutoTokenizer

    from steploop.gpu_worker.structured_output import StructuredOutput
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return StructuredOutput(model_dir, len(tokenizer)), tokenizer


def allowed(matcher, vocab_size: int) -> torch.Tensor:
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    bits = mask[0].view(-1, 1).bitwise_right_shift(torch.arange(32)).bitwise_and(1).flatten()
    return bits[:vocab_size].bool()


def test_each_choice_and_only_the_choices_fit(structured):
    so, tokenizer = structured
    grammar = so.compile(SamplingParams(regex=choice_regex(CHOICES, "guided_choice")))
    eos = tokenizer.eos_token_id
    for choice in CHOICES:
        matcher = xgr.GrammarMatcher(grammar)
        for token in tokenizer.encode(choice, add_special_tokens=False):
            assert matcher.accept_token(token), (choice, tokenizer.decode([token]))
        assert allowed(matcher, so.vocab_size)[eos], choice            # complete: the output may end here
        assert matcher.accept_token(eos) and matcher.is_terminated()
    for other in ["maybe", "ye", "yes!", "a.b (c)", "xy", "a"]:
        matcher = xgr.GrammarMatcher(grammar)
        tokens = tokenizer.encode(other, add_special_tokens=False)
        fits = all(matcher.accept_token(t) for t in tokens)
        assert not (fits and matcher.accept_token(eos)), other        # never a finished output


def test_a_regex_that_cannot_compile_is_refused_not_served_empty(structured):
    so, _ = structured
    with pytest.raises(GrammarRefused) as refused:
        so.compile(SamplingParams(regex="(a\0b|c"))     # the gateway refuses it; a direct Engine client may not
    assert refused.value.failure.param == "regex" and "does not compile" in refused.value.failure.message
