"""grammar_lint names what xgrammar would compile by ignoring it (lookarounds, inline flags, `not`, `if`), and
leaves literal look-alikes (escaped, inside a character class, in data such as `enum`) alone."""

from __future__ import annotations

import json

import pytest

from steploop.common.grammar_lint import regex_problem, schema_problem


@pytest.mark.parametrize("regex, found", [
    ("^(?=.*[0-9])[a-z0-9]{4}$", "lookahead (?=...) at position 1"),
    ("a(?!b)", "negative lookahead (?!...) at position 1"),
    ("(?<=a)b", "lookbehind (?<=...) at position 0"),
    ("(?<!a)b", "negative lookbehind (?<!...) at position 0"),
    ("(?i)abc", "inline flag group (?i) at position 0"),
    ("(?i:abc)", "inline flag group (?i: at position 0"),
])
def test_regex_constructs_named(regex, found):
    assert regex_problem(regex) == found


@pytest.mark.parametrize("regex", [r"\(?=a", "[(?=]x", "[](?=]", "[^](?!]", "(?:ab)+", "(?P<n>a)", "a?=b", "",
                                   r"[a-z\]](?:x)"])
def test_literal_look_alikes_pass(regex):
    assert regex_problem(regex) is None


@pytest.mark.parametrize("schema, found", [
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}}},
     "pattern at /properties/code/pattern: lookahead (?=...) at position 1"),
    ({"$defs": {"A/B": {"type": "string", "pattern": "(?!x)"}}}, "pattern at /$defs/A~1B/pattern: negative lookahead"),
    ({"type": "object", "patternProperties": {"^(?=a)": {}}}, "pattern at /patternProperties/^(?=a): lookahead"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "integer"}}]}, "keyword 'not' at /anyOf/1"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "keyword 'if' / 'then' / 'else' at /"),
    ({"type": "array", "items": {"type": "string", "pattern": "(?i)x"}}, "pattern at /items/pattern: inline flag"),
])
def test_schema_parts_named(schema, found):
    assert schema_problem(json.dumps(schema)).startswith(found)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"},
                                      "pattern": {"type": "string", "pattern": "^[a-z]+$"}}},
    {"enum": [{"pattern": "(?=x)"}], "default": {"not": 1}},
    {"type": "string", "pattern": r"\(?=literal"},
])
def test_schema_names_and_data_pass(schema):
    assert schema_problem(json.dumps(schema)) is None
    assert schema_problem("{not json") is None      # the compiler reports that itself
