"""Structural tags (vLLM's `structural_tag`) in the one form xgrammar compiles.

vLLM takes two spellings: xgrammar's own ({"type": "structural_tag", "format": {...}}) and its older
{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}, which vLLM compiles with
xgrammar's deprecated two-argument call. The older one is rewritten here into the first (as xgrammar's
StructuralTag.from_legacy_structural_tag does), so the gateway's check and the worker compile the same text. Pure
Python: neither side needs xgrammar (nor pydantic) for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from steploop.common.grammar_lint import schema_problem


def normalize_structural_tag(text: str) -> str:
    """The tag as xgrammar's JSON text. Raises ValueError (a message for the client) for a malformed older form."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or "structures" not in tag:
        return text
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("'structures' must be a non-empty array of {begin, schema, end} objects")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("'triggers' must be a non-empty array of non-empty strings")
    tags = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"structures[{i}] must have string 'begin' and 'end'")
        schema = item.get("schema", {})
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, (dict, bool)):   # a client's malformed tag: one error type for the caller
            raise ValueError(f"structures[{i}].schema must be a JSON schema object")  # noqa: TRY004
        tags.append({"type": "tag", "begin": item["begin"], "end": item["end"],
                     "content": {"type": "json_schema", "json_schema": schema}})
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}})


def embedded_schemas(text: str) -> Iterator[str]:
    """The JSON schemas a structural tag holds (as JSON text), for grammar_lint.schema_problem."""
    try:
        stack: list[Any] = [json.loads(text)]
    except ValueError:
        return
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                yield json.dumps(node["json_schema"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def structural_tag_problem(text: str) -> str | None:
    """What in the tag's schemas xgrammar would not enforce (grammar_lint.schema_problem), or None."""
    return next((p for schema in embedded_schemas(text) if (p := schema_problem(schema)) is not None), None)
