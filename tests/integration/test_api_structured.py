"""Structured output: with response_format json_schema / json_object the output always parses and validates."""

from __future__ import annotations

import json

import pytest

from tests.integration.api_helpers import MODEL, client

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON.", "Invent a cat.", "Give me a record."]


def _validate(value, schema=SCHEMA) -> None:
    import jsonschema_rs
    jsonschema_rs.validate(schema, value)


def test_json_schema_output_always_validates(cluster):
    """Three seeded prompts at once (unstreamed) and one streamed: every output parses and validates."""
    import asyncio

    from tests.integration.api_helpers import aclient

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def kwargs(i, prompt):
        return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0.7, "seed": i,
                    "max_tokens": 64, "response_format": fmt}

    async def run_all():
        c = aclient(cluster)
        results = await asyncio.gather(*(c.chat.completions.create(**kwargs(i, p)) for i, p in enumerate(PROMPTS)))
        await c.close()
        return results

    for r in asyncio.run(run_all()):
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        _validate(json.loads(r.choices[0].message.content))
    text = "".join(c.choices[0].delta.content or "" for c in
                   client(cluster).chat.completions.create(**kwargs(9, PROMPTS[0]), stream=True) if c.choices)
    _validate(json.loads(text))


def test_json_object_parses(cluster):
    r = client(cluster).completions.create(model=MODEL, prompt="A JSON object about the moon:", temperature=0.7,
                                           seed=3, max_tokens=24, extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")
