"""Regex constructs that xgrammar accepts but does not enforce, found before anything is compiled.

xgrammar (0.2.9) compiles a JSON schema whose string `pattern` holds a lookahead by logging "Lookahead assertion is
not supported and is ignored" and going on, so `^(?=.*[0-9])[a-z0-9]{4}$` would let "deff" through; an inline flag
such as `(?i)` in a pattern compiles silently and is not applied, and so do the schema keywords `not` and
`if`/`then`/`else`. A constraint enforced only in part is refused by name instead (the gateway answers 400; the worker ends the request with its error). Pure Python: the gateway and
the worker both use it, and neither needs xgrammar for it.
"""

from __future__ import annotations

import json
import re
from typing import Any

# After "(?": what xgrammar ignores, and how a client would recognise it.
_LOOKAROUND = (("<=", "lookbehind (?<=...)"), ("<!", "negative lookbehind (?<!...)"),
               ("=", "lookahead (?=...)"), ("!", "negative lookahead (?!...)"))
_INLINE_FLAGS = re.compile(r"[aiLmsux-]+[:)]")


def regex_problem(regex: str) -> str | None:
    """What in `regex` would not be enforced ("lookahead (?=...) at position 1"), or None. Escapes and character
    classes are skipped, so `\\(?=` and `[(?=]` are literal text, not groups."""
    i, n, in_class = 0, len(regex), False
    while i < n:
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if regex.startswith("]", i + 1) or regex.startswith("^]", i + 1):   # a leading ] is literal
                i += 2 if regex[i + 1] == "]" else 3
                continue
        elif ch == "(" and regex.startswith("?", i + 1):
            rest = regex[i + 2:]
            for prefix, name in _LOOKAROUND:
                if rest.startswith(prefix):
                    return f"{name} at position {i}"
            flags = _INLINE_FLAGS.match(rest)
            if flags:
                return f"inline flag group (?{flags.group(0)} at position {i}"
        i += 1
    return None


# JSON Schema keywords whose values are schemas, by shape; anything else (enum, const, default, examples, names of
# properties) is data and is not searched.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")
# Keywords xgrammar (0.2.9) compiles by ignoring: the output would not be held to them.
IGNORED_KEYWORDS = {"not": "'not'", "if": "'if' / 'then' / 'else'", "then": "'if' / 'then' / 'else'",
                    "else": "'if' / 'then' / 'else'"}


def schema_problem(schema_text: str) -> str | None:
    """The first part of a JSON schema that would not be enforced, e.g. "pattern at /properties/code/pattern:
    lookahead (?=...) at position 1" or "keyword 'not' at /properties/a", or None."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return None      # not JSON: the compiler says so itself
    return _walk(schema, "")


def _walk(node: Any, pointer: str) -> str | None:
    if isinstance(node, list):       # draft 4-7 tuple `items`
        return next((p for i, item in enumerate(node) if (p := _walk(item, f"{pointer}/{i}")) is not None), None)
    if not isinstance(node, dict):
        return None
    regexes = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
    regexes += [(f"patternProperties/{_escape(r)}", r) for r in node.get("patternProperties") or ()
                if isinstance(node["patternProperties"], dict)]
    for where, regex in regexes:
        problem = regex_problem(regex)
        if problem is not None:
            return f"pattern at {pointer}/{where}: {problem}"
    for key, name in IGNORED_KEYWORDS.items():
        if key in node:
            return f"keyword {name} at {pointer or '/'}"
    children: list[tuple[str, Any]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            children += [(f"{key}/{_escape(name)}", sub) for name, sub in node[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            children += [(f"{key}/{i}", sub) for i, sub in enumerate(node[key])]
    children += [(key, node[key]) for key in _SCHEMA_ONE if key in node]
    return next((p for where, sub in children if (p := _walk(sub, f"{pointer}/{where}")) is not None), None)


def _escape(name: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")
