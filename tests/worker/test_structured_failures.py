"""A grammar the worker cannot serve as asked fails its request alone (StepResult.failed), through the real
ModelRunner and xgrammar: never served as "any JSON object", never ended with an empty output. The other request
of the same steps samples exactly what it samples alone; a plan still in flight that names the failed request
(async scheduling) runs without breaking the step."""

from __future__ import annotations

import json

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import CachedRequestData, NewRequestData, StepPlan
from steploop.gpu_worker.structured_output import GRAMMAR_ERROR, GrammarRefused, StructuredOutput

LOOKAHEAD = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}},
             "required": ["code"]}
UNCLOSED = {"type": "object", "properties": {"code": {"type": "string", "pattern": "([a-z]"}}}


@pytest.fixture(scope="module")
def structured(model_dir):
    from transformers import AutoTokenizer

    return StructuredOutput(model_dir, len(AutoTokenizer.from_pretrained(str(model_dir))))


@pytest.mark.parametrize("params, param, words", [
    (SamplingParams(json_schema=json.dumps(UNCLOSED)), "json_schema", "JSON schema does not compile"),
    (SamplingParams(json_schema=json.dumps(LOOKAHEAD)), "json_schema", "lookahead (?=...)"),
    (SamplingParams(regex="[a-z]+(?!x)"), "regex", "negative lookahead"),
    (SamplingParams(regex="(ab"), "regex", "regex does not compile"),
    (SamplingParams(json_schema='{"type": "object", "properties": {"a": {"not": {"type": "string"}}}}'),
     "json_schema", "keyword 'not' at /properties/a"),
])
def test_compile_refuses_by_name(structured, params, param, words):
    with pytest.raises(GrammarRefused) as refused:
        structured.compile(params)
    failure = refused.value.failure
    assert (failure.code, failure.param) == (GRAMMAR_ERROR, param) and words in failure.message


def test_good_grammars_still_compile(structured):
    for params in (SamplingParams(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}'),
                   SamplingParams(json_object=True), SamplingParams(regex=r"\(?=[a-z]{2}")):   # escaped: literal
        assert structured.compile(params) is not None


def _new(handle: int, ids: list[int], params: SamplingParams, first_block: int) -> NewRequestData:
    return NewRequestData(handle, ids, [], params, list(range(first_block, first_block + 4)), 0)


@pytest.mark.slow
def test_a_bad_grammar_fails_its_request_alone(fresh_runner, model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))("Give me a code:").input_ids
    alone = fresh_runner.execute(StepPlan(0, new_requests=[_new(1, ids, SamplingParams(), 1)],
                                          scheduled_handles=[1], num_scheduled_tokens=[len(ids)]))
    expected = alone.sampled[1] + fresh_runner.execute(_decode(1, [1], len(ids))).sampled[1]
    fresh_runner.reset()

    bad = SamplingParams(json_schema=json.dumps(LOOKAHEAD))
    first = fresh_runner.execute(StepPlan(0, new_requests=[_new(1, ids, SamplingParams(), 1), _new(2, ids, bad, 5)],
                                          scheduled_handles=[1, 2], num_scheduled_tokens=[len(ids), len(ids)]))
    assert not first.error and set(first.failed) == {2} and 2 not in first.sampled
    assert first.failed[2].param == "json_schema" and "lookahead" in first.failed[2].message
    # Async scheduling: the next plan was built before the failure was known and still names handle 2.
    second = fresh_runner.execute(_decode(1, [1, 2], len(ids)))
    assert not second.error and 2 not in second.sampled and not second.failed   # reported once
    assert first.sampled[1] + second.sampled[1] == expected
    third = fresh_runner.execute(StepPlan(2, scheduled_handles=[1], num_scheduled_tokens=[1], finished_handles=[2]))
    assert not third.error and list(third.sampled) == [1]


def _decode(step_id: int, handles: list[int], num_prompt: int) -> StepPlan:
    cached = CachedRequestData()
    for h in handles:
        cached.append(h, num_prompt, [])
    return StepPlan(step_id, cached=cached, scheduled_handles=handles, num_scheduled_tokens=[1] * len(handles))
