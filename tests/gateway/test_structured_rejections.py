"""Structured-output constraints that cannot be enforced as written are errors, never a 200 with unconstrained or
empty output: checked at admission (grammar_check.py: xgrammar compiles each distinct constraint once, in a helper
process) with a 400 naming the field, and, for what only the worker finds, a REJECTED finish mapped to a 400 (or an
error event then [DONE] once a stream is under way). Anthropic's and the Responses API answer in their own shapes,
never 500."""

from __future__ import annotations

import json
import subprocess
import sys

import aiohttp
import pytest

from steploop.gateway.grammar_check import CHECKER, GrammarChecker
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.test_gateway_errors import CHAT, assert_error, post

LOOKAHEAD = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}},
             "required": ["code"]}
# Valid JSON schemas (jsonschema's own check passes them) that xgrammar cannot compile.
EMPTY_RANGE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}
WORD_BOUNDARY = {"type": "string", "pattern": "\\bcode"}
GOOD = {"type": "object", "properties": {"a": {"type": "integer"}}}
COMPLETION = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}


def json_schema(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("extra, field, words", [
    (json_schema(EMPTY_RANGE), "response_format.json_schema", "does not compile: Invalid range"),
    (json_schema(LOOKAHEAD), "response_format.json_schema", "lookahead (?=...)"),
    ({"guided_json": WORD_BOUNDARY}, "guided_json", "Word boundary is not supported"),
    ({"structured_outputs": {"json": LOOKAHEAD}}, "structured_outputs.json", "lookahead"),
    ({"guided_regex": "(ab"}, "guided_regex", "does not compile"),
    ({"guided_regex": "[a-z]+(?<!x)"}, "guided_regex", "lookbehind"),
    ({"structured_outputs": {"regex": "^a$b"}}, "structured_outputs.regex", "xgrammar would drop part of it"),
    ({"guided_json": {"type": "string", "pattern": "a\\Zb"}}, "guided_json", "Escape sequence"),
    (json_schema({"if": {"type": "integer"}, "then": {"minimum": 5}}), "response_format.json_schema",
     "keyword 'if' / 'then' / 'else' at /"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar",
     'does not compile: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ({"structured_outputs": {"grammar": "start ::= \"a\""}}, "structured_outputs.grammar",
     'The root rule with name "root" is not found'),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "bogus"}}}, "structural_tag",
     "Format type not recognized: bogus"),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": LOOKAHEAD, "end": "</f>"}], "triggers": ["<f"]})}},
     "structured_outputs.structural_tag", "lookahead (?=...)"),
])
@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_a_constraint_that_cannot_be_enforced_is_400_naming_the_field(gateway, path, base, extra, field,
                                                                             words):
    for stream in (False, True):
        status, body, _ = await post(gateway, path, {**base, **extra, "stream": stream})
        assert status == 400, body
        assert_error(body, param=field, code="invalid_grammar")
        assert body["error"]["message"].startswith(f"'{field}'") and words in body["error"]["message"], body
    assert gateway.engine.requests == []          # refused before anything was generated


async def test_good_constraints_pass_and_each_is_compiled_once(gateway):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"type": "string"}}}
    before = CHECKER.num_compiles
    for _ in range(3):
        assert (await post(gateway, "/v1/chat/completions", {**CHAT, **json_schema(schema)}))[0] == 200
    assert (await post(gateway, "/v1/chat/completions", {**CHAT, "guided_choice": ["yes", "no"]}))[0] == 200
    assert CHECKER.num_compiles - before == 2     # the schema once, the choice's regex once
    assert json.loads(gateway.engine.requests[0].sampling.json_schema) == schema


async def test_responses_and_messages_refuse_by_field_too(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/v1/responses", json={
                "model": SERVED_NAME, "input": "x",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": LOOKAHEAD}}}) as resp:
            status, body = resp.status, await resp.json()
        assert status == 400 and body["error"]["param"] == "text.format.schema", body
        tool = {"name": "f", "input_schema": LOOKAHEAD}
        async with http.post(f"{gateway.url}/v1/messages", json={
                "model": SERVED_NAME, "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
                "tools": [tool], "tool_choice": {"type": "tool", "name": "f"}}) as resp:
            status, body = resp.status, await resp.json()
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        assert "'tools'" in body["error"]["message"] and "lookahead" in body["error"]["message"]
    assert gateway.engine.requests == []


async def test_a_worker_rejection_is_400_naming_the_field(gateway):
    """What the admission check let through and the worker could not serve (FinishReason.REJECTED)."""
    gateway.engine.reject_after = 0
    status, body, _ = await post(gateway, "/v1/chat/completions", {**CHAT, **json_schema(GOOD)})
    assert status == 400
    assert_error(body, param="response_format.json_schema", code="invalid_grammar")
    assert "does not compile: scripted" in body["error"]["message"]
    status, body, _ = await post(gateway, "/v1/chat/completions", {**CHAT, **json_schema(GOOD), "stream": True})
    assert status == 400                         # nothing was sent yet: the real status
    assert_error(body, param="response_format.json_schema", code="invalid_grammar")


async def test_a_worker_rejection_mid_stream_is_an_error_event_then_done(gateway):
    gateway.engine.reject_after = 2
    status, body, _ = await post(gateway, "/v1/chat/completions", {**CHAT, "guided_regex": "[a-z ]+", "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert_error(json.loads(events[-2]), param="guided_regex", code="invalid_grammar")
    assert all("error" not in json.loads(e) for e in events[:-2])


async def test_worker_rejections_in_anthropic_and_responses_shapes(gateway):
    gateway.engine.reject_after = 0
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/v1/responses", json={
                "model": SERVED_NAME, "input": "x",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": GOOD}}}) as resp:
            status, body = resp.status, await resp.json()
        assert status == 400 and body["error"]["param"] == "text.format.schema", body
        async with http.post(f"{gateway.url}/v1/messages", json={
                "model": SERVED_NAME, "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "f", "input_schema": GOOD}], "tool_choice": {"type": "any"}}) as resp:
            status, body = resp.status, await resp.json()
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        async with http.post(f"{gateway.url}/v1/messages", json={
                "model": SERVED_NAME, "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
                "stream": True, "tools": [{"name": "f", "input_schema": GOOD}],
                "tool_choice": {"type": "any"}}) as resp:
            assert resp.status < 500, await resp.text()


async def test_without_the_helper_the_worker_decides(monkeypatch):
    """xgrammar missing at the gateway: requests pass (the worker's per-request error is the backstop); the lint
    still refuses what it knows by name."""
    checker = GrammarChecker()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert await checker.problem("regex", "(ab") is None and checker.num_compiles == 0
    assert "lookahead" in await checker.problem("regex", "(?=a)b")
    checker.close()


def test_the_helper_never_imports_torch():
    ask = json.dumps({"kind": "json_schema", "text": json.dumps(LOOKAHEAD)}) + "\n"
    script = ("import sys, runpy\n"
              "try:\n    runpy.run_module('steploop.gateway.grammar_helper', run_name='__main__')\n"
              "finally:\n    print(sys.modules.get('torch') is not None, file=sys.__stdout__)")
    out = subprocess.run([sys.executable, "-c", script], input=ask, capture_output=True, text=True, check=True,
                         timeout=120)
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[1])["warnings"] and "Lookahead" in json.loads(lines[1])["warnings"][0]
    assert lines[-1] == "False"      # (the helper blocks torch with a None entry in sys.modules)
