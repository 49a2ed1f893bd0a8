"""vLLM's prompt_logprobs end to end (completions and chat, through the openai SDK's extra_body) against
transformers' logits: each prompt token's logprob within 1e-4, its rank and top k the same, with prefix caching on
and the prompt's blocks already cached by an earlier request (a request asking for prompt logprobs takes no
prefix hits, so nothing comes from a stale or skipped position)."""

from __future__ import annotations

import pytest

from tests.integration.api_helpers import MODEL, client, reference_log_softmax

pytestmark = pytest.mark.slow

ATOL = 1e-4    # per unit of |logprob| past 1: a token at -15 carries fp32 rounding of ~1e-4 (measured 1.04e-4)
K = 3
PROMPT = ("Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain. "
          "Rome is the capital of")


def check_against_reference(hf, ids, entries):
    ref = reference_log_softmax(hf, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        row, token, entry = ref[j - 1], ids[j], entries[j]
        own, want = entry[str(token)], row[token].item()
        tol = ATOL * max(1.0, abs(want))
        assert abs(own["logprob"] - want) < tol, (j, own, want)
        # the same rank; tokens within the tolerance of it (a near tie) may sit on either side
        assert int((row > want + tol).sum()) + 1 <= own["rank"] <= int((row > want - tol).sum()) + 1, (j, own)
        assert own["decoded_token"] == hf.tokenizer.decode([token])
        top = sorted(((e["rank"], int(t), e["logprob"]) for t, e in entry.items()
                      if int(t) != token or e["rank"] <= K), key=lambda x: x[0])[:K]
        values, ref_ids = row.topk(K)
        assert [t for _, t, _ in top] == ref_ids.tolist(), j
        assert all(abs(x - v) < ATOL for (_, _, x), v in zip(top, values.tolist()))


def test_completions_prompt_logprobs_with_the_prefix_cached(cluster, hf):
    ids = hf.text_ids(PROMPT)
    api = client(cluster)
    api.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)      # caches the prompt's blocks
    for _ in range(2):
        r = api.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                   extra_body={"prompt_logprobs": K}).to_dict()
        check_against_reference(hf, ids, r["choices"][0]["prompt_logprobs"])


def test_chat_prompt_logprobs(cluster, hf):
    messages = [{"role": "user", "content": "Name the capital of Italy."}]
    r = client(cluster).chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                                extra_body={"prompt_logprobs": K}).to_dict()
    check_against_reference(hf, hf.chat_ids(messages), r["prompt_logprobs"])
