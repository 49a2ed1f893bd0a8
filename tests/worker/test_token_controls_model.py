"""allowed_token_ids and bad_words on the default model through ModelRunner: over 200 seeded samples neither is
ever violated (checked against the rules written out here), also when logit_bias pushes toward what they ban,
and a multi-token bad word bans only its last token after its prefix (its first token still comes out)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from steploop.common.sampling_params import SamplingParams
from tests.worker.driver import Driver

pytestmark = pytest.mark.slow

SAMPLES = 200
WAVE = 200                 # one block each (prompt + output < block size): the pool holds them all
MAX_TOKENS = 5
PROMPT = "Once upon a time, there"


def sample_all(runner, prompt: list[int], **controls) -> list[list[int]]:
    """SAMPLES seeded samples, in waves the test runner's KV pool holds."""
    outputs: dict[int, list[int]] = {}
    for wave in range(0, SAMPLES, WAVE):
        runner.reset()
        driver = Driver(runner)
        for seed in range(wave, wave + WAVE):
            driver.add(seed, prompt, MAX_TOKENS, SamplingParams(temperature=1.0, seed=seed, **controls))
        outputs.update(driver.run(64))
    runner.reset()
    return [outputs[h] for h in range(SAMPLES)]


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)(PROMPT).input_ids


@pytest.fixture(scope="module")
def free_run(runner, prompt) -> list[list[int]]:
    return sample_all(runner, prompt)


def contains(output: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(output[i:i + len(word)]) == word for i in range(len(output) - len(word) + 1))


def test_allowed_token_ids_are_never_left(runner, prompt, free_run):
    counts = Counter(t for out in free_run for t in out)
    common = [t for t, _ in counts.most_common(12)]
    allowed, pushed = tuple(sorted(common[2:10])), common[0]          # the two likeliest are not allowed
    outputs = sample_all(runner, prompt, allowed_token_ids=allowed, logit_bias=((pushed, 100.0),))
    assert all(t in allowed for out in outputs for t in out)
    assert len({t for out in outputs for t in out}) > 1               # sampled among them, not stuck on one


def test_bad_words_are_never_generated(runner, prompt, free_run):
    firsts = Counter(out[0] for out in free_run)
    single = firsts.most_common(1)[0][0]
    bigrams = Counter((a, b) for out in free_run for a, b in pairwise(out) if single not in (a, b))
    pair = bigrams.most_common(1)[0][0]
    assert sum(contains(out, pair) for out in free_run) >= 5          # the free run does say them
    outputs = sample_all(runner, prompt, bad_words=((single,), pair), logit_bias=((single, 100.0),))
    assert not any(single in out for out in outputs)
    assert not any(contains(out, pair) for out in outputs)
    assert any(pair[0] in out for out in outputs)                     # only the pair's last token is banned
