"""vLLM's extra request fields beyond OpenAI's that steploop does not build, and vLLM's own names for structured
output, for /v1/completions and /v1/chat/completions.

Unknown fields are ignored (the OpenAI SDK passes extra_body through), but a field vLLM documents, that changes
what is generated or how the answer is shaped, must not be dropped silently: a client that sends
`allowed_token_ids` and gets tokens outside them was served wrong output. So each of those is a 400 naming it,
unless it holds its default (null, or the value vLLM treats as "off"), which clients often send.

Structured output has several spellings: OpenAI's `response_format` (protocol.py), vLLM's `structured_outputs`
({"json": schema}, {"json_object": true}, {"choice": [...]}, {"regex": "..."}, {"grammar": "..."} or
{"structural_tag": "..."}) and its older `guided_json`, `guided_choice`, `guided_regex`, `guided_grammar` and
`structural_tag`. They name one constraint; two of them in one request (or two keys of structured_outputs) is a
400. A choice becomes a regex of its escaped alternatives. A grammar is EBNF / GBNF as xgrammar reads it (start rule
`root`); a structural tag is xgrammar's JSON (vLLM's {"structures": [{"begin", "schema", "end"}], "triggers"} form
included). Every constraint is compiled at admission (grammar_check.py): one that xgrammar cannot compile, or
would enforce only in part, is a 400 naming its field and xgrammar's message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from steploop.common.structural_tag import normalize_structural_tag
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v

# field -> the values that mean "not used" (sent by clients that fill every field)
NOT_BUILT: dict[str, tuple[Any, ...]] = {
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
    "mm_processor_kwargs": (None, {}),
    "chat_template": (None,),                # a per-request template (vLLM refuses it too unless trusted)
    "documents": (None, []),                 # RAG documents for the template
}
STRUCTURED_KEYS = ("json", "choice", "regex", "grammar", "structural_tag", "json_object")
MAX_GRAMMAR_CHARS = 1_000_000    # a grammar or structural tag's text at most (the same bound as a request body)
REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/")     # escaped in a choice: everything else is literal
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint: a JSON schema, any JSON object, a regex, an EBNF grammar or a structural tag
    (field "" = none)."""
    field: str                       # the request field that named it
    schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str = ""
    grammar: str = ""                # EBNF / GBNF text
    structural_tag: str = ""         # JSON text


def not_supported(name: str) -> Exception:
    return bad_request(f"'{name}' is not supported yet by steploop", param=name, code="unsupported_parameter")


def refuse_not_built(body: dict[str, Any]) -> None:
    for name, unused in NOT_BUILT.items():
        if name in body and not any(body[name] == value and type(body[name]) is type(value) for value in unused):
            raise not_supported(name)


def _schema_object(value: Any, where: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    param = where.split(".")[0]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"'{where}' must be a JSON schema (an object, or its JSON text)", param=param) from None
    if not isinstance(value, dict):
        raise v.type_error(where, "a JSON schema object", value, param=param)
    v.check_json_schema(value, where, param)
    return value


def choice_regex(choices: Any, where: str) -> str:
    """guided_choice -> a regex matching exactly one of the strings."""
    param = where.split(".")[0]
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"'{where}' must be a non-empty array of non-empty strings", param=param)
    if any("\0" in c for c in choices):           # xgrammar's regexes cannot hold NUL
        raise bad_request(f"'{where}' strings must not contain NUL (\\u0000)", param=param)
    if len(choices) > MAX_CHOICES:
        raise bad_request(f"'{where}' has {len(choices)} choices; at most {MAX_CHOICES}", param=param)
    return "(" + "|".join("".join("\\" + ch if ch in REGEX_SPECIAL else ch for ch in c) for c in choices) + ")"


def user_regex(value: Any, where: str) -> str:
    """guided_regex / structured_outputs.regex: a non-empty string (xgrammar's dialect; compiled at admission)."""
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{where}' must be a non-empty regular expression string", param=where)
    if "\0" in value:                               # xgrammar's regexes cannot hold NUL
        raise bad_request(f"'{where}' must not contain NUL (\\u0000)", param=where)
    return value


def user_grammar(value: Any, where: str) -> str:
    """guided_grammar / structured_outputs.grammar: EBNF / GBNF text (compiled at admission)."""
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{where}' must be a non-empty grammar string (EBNF / GBNF with a 'root' rule)",
                          param=where)
    if len(value) > MAX_GRAMMAR_CHARS or "\0" in value:
        raise bad_request(f"'{where}' must be at most {MAX_GRAMMAR_CHARS} characters, without NUL", param=where)
    return value


def user_structural_tag(value: Any, where: str) -> str:
    """structural_tag / structured_outputs.structural_tag: xgrammar's structural tag as JSON text (an object is
    taken too); its content is checked by compiling it at admission."""
    if isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{where}' must be a structural tag (a JSON object, or its JSON text)", param=where)
    try:
        parsed = json.loads(value)
    except ValueError:
        raise bad_request(f"'{where}' must be a structural tag (a JSON object, or its JSON text)",
                          param=where) from None
    if not isinstance(parsed, dict) or len(value) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{where}' must be a JSON object of at most {MAX_GRAMMAR_CHARS} characters", param=where)
    try:
        return normalize_structural_tag(value)
    except ValueError as exc:
        raise bad_request(f"'{where}' is not a valid structural tag: {exc}", param=where) from None


def _structured_outputs(spec: dict[str, Any]) -> Constraint | None:
    """vLLM's structured_outputs object: exactly one of its keys (json_object false counts as unset)."""
    keys = [k for k in STRUCTURED_KEYS if spec.get(k) is not None and not (k == "json_object" and spec[k] is False)]
    if len(keys) > 1:
        raise bad_request(f"'structured_outputs' sets {', '.join(keys)}: give one constraint",
                          param=f"structured_outputs.{keys[1]}")
    if not keys:
        return None
    key, where = keys[0], f"structured_outputs.{keys[0]}"
    if key == "json":
        return Constraint("structured_outputs", schema=_schema_object(spec["json"], where))
    if key == "choice":
        return Constraint("structured_outputs", regex=choice_regex(spec["choice"], where))
    if key == "regex":
        return Constraint(where, regex=user_regex(spec["regex"], where))
    if key == "grammar":
        return Constraint(where, grammar=user_grammar(spec["grammar"], where))
    if key == "structural_tag":
        return Constraint(where, structural_tag=user_structural_tag(spec["structural_tag"], where))
    v.get_bool(spec, "json_object", False)          # a 400 unless a boolean
    return Constraint("structured_outputs", json_object=True)


def structured_output(body: dict[str, Any]) -> Constraint | None:
    """The constraint named by `structured_outputs` or a `guided_*` field; None when none is."""
    found = []
    if body.get("guided_json") is not None:
        found.append(Constraint("guided_json", schema=_schema_object(body["guided_json"], "guided_json")))
    if body.get("guided_choice") is not None:
        found.append(Constraint("guided_choice", regex=choice_regex(body["guided_choice"], "guided_choice")))
    if body.get("guided_regex") is not None:
        found.append(Constraint("guided_regex", regex=user_regex(body["guided_regex"], "guided_regex")))
    if body.get("guided_grammar") is not None:
        found.append(Constraint("guided_grammar", grammar=user_grammar(body["guided_grammar"], "guided_grammar")))
    if body.get("structural_tag") is not None:
        found.append(Constraint("structural_tag",
                                structural_tag=user_structural_tag(body["structural_tag"], "structural_tag")))
    spec = v.get_object(body, "structured_outputs")
    if spec:
        constraint = _structured_outputs(spec)
        if constraint is not None:
            found.append(constraint)
    if len(found) > 1:
        raise bad_request(f"'{found[0].field}' and '{found[1].field}' name the same constraint: give one",
                          param=found[1].field)
    return found[0] if found else None
