"""vLLM's extra request fields beyond OpenAI's that steploop does not build, and vLLM's own names for structured
output, for /v1/completions and /v1/chat/completions.

Unknown fields are ignored (the OpenAI SDK passes extra_body through), but a field vLLM documents, that changes
what is generated or how the answer is shaped, must not be dropped silently: a client that sends
`allowed_token_ids` and gets tokens outside them was served wrong output. So each of those is a 400 naming it,
unless it holds its default (null, or the value vLLM treats as "off"), which clients often send.

Structured output has several spellings: OpenAI's `response_format` (protocol.py), vLLM's `structured_outputs`
({"json": schema}, {"json_object": true}, {"choice": [...]} or {"regex": "..."}; grammar and structural_tag are
not built) and its older `guided_json`, `guided_choice` and `guided_regex`. They name one constraint; two of them in
one request is a 400. A choice becomes a regex of its escaped alternatives. A regex or schema is compiled at
admission (grammar_check.py): one that xgrammar cannot compile, or would enforce only in part, is a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v

# field -> the values that mean "not used" (sent by clients that fill every field)
NOT_BUILT: dict[str, tuple[Any, ...]] = {
    "guided_grammar": (None,),
    "structural_tag": (None,),
    "use_beam_search": (None, False),
    "logits_processors": (None, []),
    "prompt_logprobs": (None,),              # completions' prompt logprobs come with echo + logprobs
    "return_tokens_as_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
    "mm_processor_kwargs": (None, {}),
    "chat_template": (None,),                # a per-request template (vLLM refuses it too unless trusted)
    "documents": (None, []),                 # RAG documents for the template
}
STRUCTURED_NOT_BUILT = ("grammar", "structural_tag")
REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/")     # escaped in a choice: everything else is literal
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint: a JSON schema, any JSON object, or a regex (field "" = none)."""
    field: str                       # the request field that named it
    schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str = ""


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


def structured_output(body: dict[str, Any]) -> Constraint | None:
    """The constraint named by `structured_outputs`, `guided_json` or `guided_choice`; None when none is."""
    found = []
    if body.get("guided_json") is not None:
        found.append(Constraint("guided_json", schema=_schema_object(body["guided_json"], "guided_json")))
    if body.get("guided_choice") is not None:
        found.append(Constraint("guided_choice", regex=choice_regex(body["guided_choice"], "guided_choice")))
    if body.get("guided_regex") is not None:
        found.append(Constraint("guided_regex", regex=user_regex(body["guided_regex"], "guided_regex")))
    spec = v.get_object(body, "structured_outputs")
    if spec:
        for key in STRUCTURED_NOT_BUILT:
            if spec.get(key) is not None:
                raise not_supported(f"structured_outputs.{key}")
        if spec.get("json") is not None:
            found.append(Constraint("structured_outputs", schema=_schema_object(spec["json"], "structured_outputs.json")))
        elif spec.get("choice") is not None:
            found.append(Constraint("structured_outputs",
                                    regex=choice_regex(spec["choice"], "structured_outputs.choice")))
        elif spec.get("regex") is not None:
            found.append(Constraint("structured_outputs.regex",
                                    regex=user_regex(spec["regex"], "structured_outputs.regex")))
        elif v.get_bool(spec, "json_object", False):
            found.append(Constraint("structured_outputs", json_object=True))
    if len(found) > 1:
        raise bad_request(f"'{found[0].field}' and '{found[1].field}' name the same constraint: give one",
                          param=found[1].field)
    return found[0] if found else None
