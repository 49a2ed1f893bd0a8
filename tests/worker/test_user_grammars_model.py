"""User grammars on the default model through ModelRunner (xgrammar, the model's tokenizer): over 200 seeded
samples each output is a full match of its pattern (checked with Python's `re`, written out here as the reference),
for a regex and for an EBNF grammar; a structural tag only constrains what follows its trigger."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from steploop.common.sampling_params import SamplingParams
from steploop.common.structural_tag import normalize_structural_tag
from tests.worker.driver import Driver

pytestmark = pytest.mark.slow

SAMPLES = 200
MAX_TOKENS = 12                   # prompt + output stay in one block each: the pool holds all 200 at once
EOS = 2
REGEX = "[a-e]{2,4}-(cat|dog)"
GRAMMAR = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?'
GRAMMAR_AS_REGEX = "(yes|no) [1-9][0-9]?"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def sample_texts(runner, tokenizer, **constraint) -> list[str]:
    prompt = tokenizer("Answer:").input_ids
    runner.reset()
    driver = Driver(runner, eos_token_id=EOS)
    for seed in range(SAMPLES):
        driver.add(seed, prompt, MAX_TOKENS, SamplingParams(temperature=1.0, seed=seed, **constraint))
    outputs = driver.run(64)
    runner.reset()
    texts = []
    for seed in range(SAMPLES):
        out = outputs[seed]
        assert EOS in out, (seed, tokenizer.decode(out))      # the grammar ended it: it ran to completion
        texts.append(tokenizer.decode(out[:out.index(EOS)]))
    return texts


@pytest.mark.parametrize("constraint, reference", [({"regex": REGEX}, REGEX),
                                                   ({"grammar": GRAMMAR}, GRAMMAR_AS_REGEX)])
def test_every_sample_matches_its_pattern(runner, tokenizer, constraint, reference):
    texts = sample_texts(runner, tokenizer, **constraint)
    bad = [t for t in texts if re.fullmatch(reference, t) is None]
    assert not bad, bad[:5]
    assert len(set(texts)) > 5                                  # sampled, not one forced string


def test_structural_tag_holds_what_follows_its_trigger(runner, tokenizer):
    from steploop.gpu_worker.structured_output import StructuredOutput
    so = StructuredOutput(runner.structured.model_dir, runner.vocab_size)
    tag = normalize_structural_tag(json.dumps({"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<f>", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
         "end": "</f>"}]}))
    grammar = so.compile(SamplingParams(structural_tag=tag))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts('Free text, then <f>{"n": 3}</f> and more')
    assert not accepts('Free text, then <f>{"m": 3}</f>')
    assert not accepts('<f>{"n": "x"}')
    mask = xgr.allocate_token_bitmask(1, runner.vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask, 0)
    assert torch.count_nonzero(mask) > 0
