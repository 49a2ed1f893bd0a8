"""A fuzz of the output-control fields (allowed_token_ids, bad_words, prompt_logprobs, guided_grammar,
structural_tag, structured_outputs, and beam search's use_beam_search, best_of, n, length_penalty,
early_stopping) on both endpoints, valid and malformed values mixed, against the fake engine:
never a 5xx, and every 400 names the field at fault."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import SERVED_NAME

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                 st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                               st.integers(), max_size=2))
GRAMMARS = st.sampled_from(['root ::= "a" | "b"', "root ::= foo", 'root ::= [0-9]+ ("x" ', "start ::= 'a'", "",
                            'root ::= "\\u0000"', "root ::= [^a]*"])
TAGS = st.sampled_from([
    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"type": "tag", "begin": "<f>", "end": "</f>", "content": {"type": "json_schema", "json_schema": {}}}]}},
    {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
     "triggers": ["<f"]},
    {"type": "structural_tag", "structures": [{"begin": 1}], "triggers": []}, {"type": "bogus"}, "{", "[]", "{}"])
FIELDS = {
    "allowed_token_ids": st.one_of(st.lists(st.integers(-2, 60000), max_size=4), JUNK),
    "bad_words": st.one_of(st.lists(st.text(max_size=6), max_size=3), JUNK),
    "prompt_logprobs": st.one_of(st.integers(-2, 25), JUNK),
    "guided_grammar": st.one_of(GRAMMARS, JUNK),
    "structural_tag": st.one_of(TAGS, TAGS.map(json.dumps), JUNK),
    "structured_outputs": st.one_of(st.fixed_dictionaries({}, optional={
        "grammar": GRAMMARS, "structural_tag": TAGS, "regex": st.sampled_from(["[a-c]+", "(a", ""]),
        "json_object": st.booleans(), "choice": st.lists(st.text(max_size=3), max_size=2)}), JUNK),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.sampled_from(["1", "5", "49151"]),
                                                       st.integers(-100, 100), max_size=2)),
    "stream": st.booleans(),
    "use_beam_search": st.one_of(st.booleans(), st.booleans(), JUNK),
    "best_of": st.one_of(st.integers(0, 20), JUNK),
    "n": st.integers(1, 5),
    "length_penalty": st.one_of(st.floats(-12, 12, allow_nan=False), JUNK),
    "early_stopping": st.one_of(st.booleans(), st.just("never"), JUNK),
}
BASES = {"/v1/completions": {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2},
         "/v1/chat/completions": {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2}}


def call(url: str, body: dict) -> tuple[int, dict | None]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return resp.status, None
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def fuzz(base_url: str, failures: list[str], statuses: set[int]) -> None:
    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(sorted(BASES)), extra=st.fixed_dictionaries({}, optional=FIELDS))
    def check(path, extra):
        status, body = call(base_url + path, {**BASES[path], **extra})
        statuses.add(status)
        if status >= 500:
            failures.append(f"{path} {extra!r} -> {status} {body}")
        elif status == 400:
            param = (body or {}).get("error", {}).get("param") or ""
            if param.split(".")[0] not in {*FIELDS, "response_format"}:
                failures.append(f"{path} {extra!r} -> 400 naming {param!r}")

    check()


async def test_no_5xx_and_400s_name_their_field(gateway):
    failures: list[str] = []
    statuses: set[int] = set()
    await asyncio.to_thread(fuzz, gateway.url, failures, statuses)     # the gateway serves on this loop meanwhile
    assert failures == []
    assert {200, 400} <= statuses                             # both served and refused cases were generated
