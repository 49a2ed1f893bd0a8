"""The output controls through the whole stack (openai SDK -> gateway -> scheduler -> worker): a grammar, a
structural tag and the token controls hold on real outputs; an id outside the model's vocabulary and an
uncompilable grammar are 400s naming the field."""

from __future__ import annotations

import re

import openai
import pytest

from tests.integration.api_helpers import MODEL, client

pytestmark = pytest.mark.slow

GRAMMAR = 'root ::= ("yes" | "no") ", " [1-9] [0-9]?'


def test_grammar_and_token_controls_hold(cluster, hf):
    api = client(cluster)
    r = api.completions.create(model=MODEL, prompt="Answer:", max_tokens=8, temperature=1.0, seed=3, n=4,
                               extra_body={"guided_grammar": GRAMMAR})
    assert all(re.fullmatch(r"(yes|no), [1-9][0-9]?", c.text) for c in r.choices), [c.text for c in r.choices]
    digits = [hf.text_ids(str(d))[0] for d in range(10)]
    r = api.completions.create(model=MODEL, prompt="Count: 1 2 3", max_tokens=6, temperature=1.0, seed=1,
                               extra_body={"allowed_token_ids": digits, "bad_words": ["7"]})
    assert r.choices[0].text and set(r.choices[0].text) <= set("012345689")


@pytest.mark.parametrize("extra, field", [({"allowed_token_ids": [49152]}, "allowed_token_ids"),
                                          ({"guided_grammar": "root ::= foo"}, "guided_grammar"),
                                          ({"guided_grammar": GRAMMAR, "guided_regex": "a"}, "guided_grammar")])
def test_bad_controls_are_400s(cluster, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        client(cluster).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, extra_body=extra)
    assert err.value.body["param"] == field
