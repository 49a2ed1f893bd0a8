"""use_beam_search end to end (openai SDK -> gateway -> scheduler -> worker) against transformers'
generate(num_beams=W, num_return_sequences=W, length_penalty, early_stopping) on the default model: for 4 prompts x
beams 2 and 4, every returned beam in the same order, with the same text and length and the same cumulative logprob
(the sum of its token logprobs) within 1e-3; and once through chat."""

from __future__ import annotations

import pytest

from tests.integration.api_helpers import MODEL, client

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The three primary colors are"]
MAX_NEW = 8


def hf_beams(hf, prompt_ids, width, penalty, early):
    torch = hf.torch
    eos = hf.model.generation_config.eos_token_id
    with torch.no_grad():
        out = hf.model.generate(torch.tensor([prompt_ids]), do_sample=False, num_beams=width,
                                num_return_sequences=width, length_penalty=penalty, early_stopping=early,
                                max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos,
                                return_dict_in_generate=True, output_scores=True)
    beams = []
    for row, indices, score in zip(out.sequences, out.beam_indices, out.sequences_scores):
        length = int((indices >= 0).sum())
        tokens = row[len(prompt_ids):len(prompt_ids) + length].tolist()
        beams.append((tokens, score.item() * length ** penalty))
    return beams


def check(hf, choices, want):
    eos = hf.model.generation_config.eos_token_id
    assert len(choices) == len(want)
    for choice, (tokens, cum) in zip(choices, want):
        shown = tokens[:-1] if tokens[-1] == eos else tokens
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert text == hf.tokenizer.decode(shown, skip_special_tokens=True), (text, tokens)
        assert choice.finish_reason == ("stop" if tokens[-1] == eos else "length")
        lps = choice.logprobs.token_logprobs if hasattr(choice.logprobs, "token_logprobs") else \
            [c.logprob for c in choice.logprobs.content]
        assert len(lps) == len(tokens)
        assert sum(lps) == pytest.approx(cum, abs=1e-3)


@pytest.mark.parametrize("width,penalty,early", [(2, 1.0, False), (4, 0.5, True)])
def test_completions_equal_transformers(cluster, hf, width, penalty, early):
    api = client(cluster)
    for prompt in PROMPTS:
        ids = hf.text_ids(prompt)
        r = api.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_NEW, n=width, logprobs=0,
                                   extra_body={"use_beam_search": True, "length_penalty": penalty,
                                               "early_stopping": early})
        check(hf, sorted(r.choices, key=lambda c: c.index), hf_beams(hf, ids, width, penalty, early))


def test_chat_equals_transformers(cluster, hf):
    messages = [{"role": "user", "content": "Name a fruit."}]
    r = client(cluster).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW, n=2,
                                                logprobs=True, extra_body={"use_beam_search": True, "best_of": 3})
    want = hf_beams(hf, hf.chat_ids(messages), 3, 1.0, False)[:2]
    check(hf, sorted(r.choices, key=lambda c: c.index), want)
