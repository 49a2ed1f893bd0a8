"""Sampling parameters through the openai SDK against the real cluster: each one has its effect, seeded
sampling repeats whatever else is in the batch, n seeded samples differ, and the first-token distribution
under temperature / top-k / top-p / min-p matches the one computed from transformers' logits."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.api_helpers import MODEL, aclient, client, reference_log_softmax

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


def test_seeded_sampling_repeats_across_runs_and_batches(cluster):
    kwargs = {"model": MODEL, "prompt": PROMPT, "temperature": 1.0, "top_p": 0.95, "max_tokens": 12, "seed": 1234}
    alone = client(cluster).completions.create(**kwargs).choices[0].text

    async def crowded():
        c = aclient(cluster)
        others = [c.completions.create(model=MODEL, prompt=f"Story {i}:", temperature=1.0, max_tokens=12)
                  for i in range(6)]
        results = await asyncio.gather(c.completions.create(**kwargs), *others)
        await c.close()
        return results[0].choices[0].text

    assert asyncio.run(crowded()) == alone
    streamed = "".join(ch.choices[0].text for ch in client(cluster).completions.create(**kwargs, stream=True)
                       if ch.choices)
    assert streamed == alone


def test_n_seeded_choices_differ_and_repeat(cluster):
    kwargs = {"model": MODEL, "prompt": PROMPT, "temperature": 1.2, "max_tokens": 8, "n": 4, "seed": 7}
    first = client(cluster).completions.create(**kwargs)
    second = client(cluster).completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens <= 32 and first.usage.prompt_tokens == second.usage.prompt_tokens


def test_logit_bias_forces_and_bans_tokens(cluster, hf):
    forced = hf.tokenizer.encode(" banana")[0]
    r = client(cluster).completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3,
                                           logit_bias={str(forced): 100})
    assert r.choices[0].text == hf.tokenizer.decode([forced] * 3)
    greedy = client(cluster).completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1)
    first = hf.tokenizer.encode(greedy.choices[0].text)[0]
    banned = client(cluster).completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1,
                                                logit_bias={str(first): -100})
    assert banned.choices[0].text != greedy.choices[0].text


def test_min_tokens_ignore_eos_and_stop_token_ids(cluster, hf):
    chat = [{"role": "user", "content": "Say OK."}]
    short = client(cluster).chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=16)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = client(cluster).chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=n + 8,
                                                     extra_body={"min_tokens": n + 4})
    assert longer.usage.completion_tokens >= n + 4
    full = client(cluster).chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=n + 6,
                                                   extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == n + 6 and full.choices[0].finish_reason == "length"
    first_id = hf.tokenizer.encode(short.choices[0].message.content)[0]
    stopped = client(cluster).chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=8,
                                                      extra_body={"stop_token_ids": [first_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].message.content == ""        # the stop token is counted, not shown (as vLLM)
    shown = client(cluster).chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=8,
                                                    extra_body={"stop_token_ids": [first_id],
                                                                "include_stop_str_in_output": True})
    assert shown.choices[0].message.content == hf.tokenizer.decode([first_id])


def test_stop_strings_and_include_stop_str(cluster):
    base = client(cluster).completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12)
    text = base.choices[0].text
    stop = text.strip().split(",")[1].strip() if "," in text else text[2:4]
    cut = client(cluster).completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12,
                                             stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    kept = client(cluster).completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12,
                                              stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop


def test_penalties_change_greedy_output(cluster):
    """A prompt whose greedy continuation repeats itself: each penalty must break the repetition."""
    prompt = "1 1 1 1 1 1 1 1"
    base = client(cluster).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        r = client(cluster).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, **extra)
        assert r.choices[0].text != base.choices[0].text, (extra, base.choices[0].text)


def test_max_tokens_default_fits_and_context_errors(cluster):
    r = client(cluster).completions.create(model=MODEL, prompt="Hi", temperature=0, max_tokens=None,
                                           extra_body={"ignore_eos": True, "max_tokens": 3})
    assert r.usage.completion_tokens == 3
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        client(cluster).completions.create(model=MODEL, prompt="Hi", max_tokens=9000)
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and "8192" in body["message"] and "9000" in body["message"]


# ---- distribution of the first sampled token ---------------------------------------------------------------

def _reference_probs(hf, ids, temperature, top_k=0, top_p=1.0, min_p=0.0):
    torch = hf.torch
    logits = reference_log_softmax(hf, ids)[-1] / temperature
    probs = logits.softmax(-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if min_p:
        keep &= probs >= min_p * probs.max()
    order = probs.argsort(descending=True)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        sorted_p = probs[order] * keep[order]
        sorted_p = sorted_p / sorted_p.sum()
        before = sorted_p.cumsum(0) - sorted_p
        keep[order[before >= top_p]] = False
    p = probs * keep
    return p / p.sum()


async def _sample_first_tokens(cluster, ids, num_requests, n, **params):
    c = aclient(cluster)
    jobs = [c.completions.create(model=MODEL, prompt=ids, max_tokens=1, n=n, seed=1000 * i, logprobs=0, **params)
            for i in range(num_requests)]
    results = await asyncio.gather(*jobs)
    await c.close()
    return [ch.logprobs.tokens[0] for r in results for ch in r.choices]


@pytest.mark.parametrize("params", [
    {"temperature": 1.0, "extra_body": {"top_k": 8}},
    {"temperature": 0.7, "top_p": 0.8, "extra_body": {"min_p": 0.02}},
])
def test_first_token_distribution_matches_reference(cluster, hf, params):
    ids = hf.text_ids("My favourite colour is")
    tokens = asyncio.run(_sample_first_tokens(cluster, ids, 20, 16, **params))   # 320 samples, fixed seeds
    extra = params.get("extra_body", {})
    probs = _reference_probs(hf, ids, params["temperature"], extra.get("top_k", 0), params.get("top_p", 1.0),
                             extra.get("min_p", 0.0))
    counts: dict[str, int] = {}
    for t in tokens:
        counts[t] = counts.get(t, 0) + 1
    support = {hf.tokenizer.decode([i]): p for i, p in enumerate(probs.tolist()) if p > 0}
    assert set(counts) <= set(support), set(counts) - set(support)     # nothing outside the truncated set
    n = len(tokens)
    # Chi-squared with tail bins pooled so every expected count is >= 5.
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for tok, p in sorted(support.items(), key=lambda kv: -kv[1]):
        if p * n >= 5:
            bins.append((counts.get(tok, 0), p * n))
        else:
            pooled_obs += counts.get(tok, 0)
            pooled_exp += p * n
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in bins)
    dof = max(len(bins) - 1, 1)
    assert chi2 < 3 * dof + 15, (chi2, dof, bins)    # loose: a real bug (wrong filter, temperature) is far off
