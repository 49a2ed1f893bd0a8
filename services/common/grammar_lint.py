"""Regex constructs that xgrammar accepts but does not enforce, found before anything is compiled.

xgrammar (0.2.9) compiles a JSON schema whose string `pattern` holds a lookahead by logging "Lookahead assertion is
not supported and is ignored" and going on, so `^(?=.*[0-9])[a-z0-9]{4}$` would let "deff" through; an inline flag
such as `(?i)` in a pattern compiles silently and is not applied. A constraint enforced only in part is refused by
name instead (the gateway answers 400; the worker ends the request with its error). Pure Python: the gateway and
the worker both use it, and neither needs xgrammar for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
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


def schema_problem(schema_text: str) -> str | None:
    """The first regex of a JSON schema (a `pattern`, a `patternProperties` key) that would not be enforced, as
    "pattern at /properties/code/pattern: lookahead (?=...) at position 1", or None."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return None      # not JSON: the compiler says so itself
    for pointer, regex in _schema_regexes(schema, ""):
        problem = regex_problem(regex)
        if problem is not None:
            return f"pattern at {pointer or '/'}: {problem}"
    return None


def _schema_regexes(node: Any, pointer: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}"
            if key == "pattern" and isinstance(value, str):
                yield here, value
            elif key == "patternProperties" and isinstance(value, dict):
                for regex in value:
                    yield f"{here}/{regex}", regex
                yield from _schema_regexes(value, here)
            else:
                yield from _schema_regexes(value, here)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _schema_regexes(item, f"{pointer}/{i}")
