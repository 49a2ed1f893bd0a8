"""Arguments written as tagged parameters (Qwen3-Coder's `<parameter=k>v</parameter>`, GLM's `<arg_key>k</arg_key>
<arg_value>v</arg_value>`) -> JSON arguments text, converted by the tool's schema as vLLM's parsers convert them.
A string parameter streams as it is written; other types once their value is complete."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steploop.gateway.text.stop_strings import held_suffix_len

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


@dataclass(frozen=True)
class Param:
    key: str
    value: str          # as written so far (between the tags, nothing stripped)
    done: bool          # its closing tag was read


def param_type(schema: Mapping[str, Any], key: str) -> str:
    """The parameter's JSON-schema type ("string" when the schema does not say: the value is kept as written)."""
    prop = (schema.get("properties") or {}).get(key)
    kind = prop.get("type", "string") if isinstance(prop, Mapping) else "string"
    return kind[0] if isinstance(kind, list) and kind else kind if isinstance(kind, str) else "string"


def convert(value: str, kind: str) -> Any:
    """A complete value as its schema type (vLLM's qwen3_coder conversion); unreadable values stay strings."""
    if kind in _STRING_TYPES:
        return value
    if value.lower() == "null":
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


def arguments_text(params: list[Param], schema: Mapping[str, Any], closed: bool, close_tag: str,
                   strip_newlines: bool) -> str:
    """The parameters read so far as a prefix of the arguments' JSON (closed: the call ended, so is the object).
    strip_newlines: one newline after the opening and before the closing tag is layout, not value (Qwen3-Coder)."""
    parts = []
    for param in params:
        kind = param_type(schema, param.key)
        value = param.value
        if strip_newlines and value.startswith("\n"):
            value = value[1:]
        if param.done:
            if strip_newlines and value.endswith("\n"):
                value = value[:-1]
            parts.append(f"{json.dumps(param.key, ensure_ascii=False)}: "
                         f"{json.dumps(convert(value, kind), ensure_ascii=False)}")
            continue
        if kind in _STRING_TYPES and (param.value or not strip_newlines):
            # "\n" + close tag may still end it: hold back what could be that
            held = held_suffix_len(value, (("\n" if strip_newlines else "") + close_tag, close_tag))
            partial = json.dumps(value[:len(value) - held], ensure_ascii=False)[:-1]
            parts.append(f"{json.dumps(param.key, ensure_ascii=False)}: {partial}")
        break
    return "{" + ", ".join(parts) + ("}" if closed else "")
