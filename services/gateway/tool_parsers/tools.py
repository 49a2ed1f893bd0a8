"""OpenAI's `tools` / `tool_choice` on /v1/chat/completions, as vLLM serves them: what may be called, and how.

- `tool_choice` "none" (or no tools): the tools are left out of the prompt and the reply is plain text.
- "auto" (the default when tools are given): the model sees the tools and may answer with calls in the format of
  the gateway's `--tool-call-parser` (tool_parsers/: Hermes by default), which become `message.tool_calls`
  (finish_reason "tool_calls"); text before the first call is the content. Text that does not parse stays content.
- "required" and a named function: the reply is constrained by the worker's structured output (xgrammar) to a
  JSON array of calls to the given tools, or to the named function's arguments, so it is always well-formed
  whatever the model (as vLLM does with guided decoding). That grammar and the reader of its output are here.

How the tools reach the prompt is chat_template.py's concern.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v
from steploop.gateway.tool_parsers import ToolCall, ToolParser
from steploop.gateway.tool_parsers.base import NewId, Schemas, loads
from steploop.gateway.tool_parsers.stream import CallSplitter, split_whole

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked of tools. `choice` is "auto", "required" or "named" ("none" is no ToolRequest)."""
    tools: tuple[Tool, ...]
    choice: str
    parser: ToolParser              # the format "auto" replies are read in (and call ids are made by)
    named: str | None = None
    parallel: bool = True

    def guided_schema(self) -> str:
        """The JSON schema that constrains the reply ("" for auto, which the model writes freely)."""
        if self.choice == "named":
            return json.dumps(next(t.parameters for t in self.tools if t.name == self.named))
        if self.choice != "required":
            return ""
        # Each tool's schema moves under $defs/tool_i, its own refs ("#/$defs/Addr", pydantic's nested models)
        # rewritten to point there, so they still resolve inside the combined schema.
        defs = {f"tool_{i}": _rebase_refs(t.parameters, f"#/$defs/tool_{i}") for i, t in enumerate(self.tools)}
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(self.tools)]
        schema: dict[str, Any] = {"$defs": defs, "type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def finish_reason(self, calls: list[ToolCall], finish: str | None) -> str | None:
        """OpenAI: "tool_calls" when the model chose to call; a forced (named) call ends with "stop"."""
        if not calls or finish == "length" or self.choice == "named":
            return finish
        return "tool_calls"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole reply -> (content, calls). A reply that does not parse is all content, no calls."""
        names, new_id = {t.name for t in self.tools}, self.parser.new_call_id
        if self.choice == "named":
            return None, [ToolCall(new_id(), self.named or "", text.strip())]
        if self.choice == "required":
            calls = _calls_from_json(text, names, new_id)
            return (None, calls) if calls else (text, [])
        content, calls = split_whole(self.parser, text, self.schemas, new_id, self.max_calls)
        return (content, calls) if calls else (content or "", [])

    @property
    def schemas(self) -> Schemas:
        return {t.name: t.parameters for t in self.tools}

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def splitter(self) -> CallSplitter:
        """The streaming reader of an "auto" reply (the same reader `parse` uses whole)."""
        return CallSplitter(self.parser, self.schemas, self.parser.new_call_id, self.max_calls)


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of a schema whose local refs ("#/...", "#") point into it at `base` of an enclosing document."""
    if isinstance(node, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    return node


def parse_tools(body: dict[str, Any], constrained_by: str, parser: ToolParser) -> ToolRequest | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> a ToolRequest, or None when no tool may be called.
    constrained_by: the request field that already constrains the reply ("" when none does)."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad_request("'functions' / 'function_call' are deprecated by OpenAI and not supported; use 'tools' "
                          "and 'tool_choice'", param="functions", code="unsupported_parameter")
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = v.get_bool(body, "parallel_tool_calls", True)
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise v.type_error("tools", "an array of tools", raw)
    tools = tuple(_parse_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"'tools' has duplicate function names: {sorted({n for n in names if names.count(n) > 1})}",
                          param="tools")
    if choice is None or choice == "auto":
        request = ToolRequest(tools, "auto", parser, parallel=parallel)
    elif choice == "none":
        return None
    elif choice == "required":
        request = ToolRequest(tools, "required", parser, parallel=parallel)
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if name not in names:
            raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools' ({names})",
                              param="tool_choice")
        request = ToolRequest(tools, "named", parser, named=name, parallel=parallel)
    else:
        raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                          param="tool_choice")
    if request.choice != "auto" and constrained_by:
        raise bad_request(f"'{constrained_by}' cannot be combined with a 'tool_choice' that forces a call (both "
                          "constrain the reply)", param=constrained_by)
    return request


def _parse_tool(tool: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise v.type_error(f"{where}.function", "an object", fn, param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                          param="tools")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise v.type_error(f"{where}.function.description", "a string", description, param="tools")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = _DEFAULT_PARAMETERS
    if not isinstance(parameters, dict):
        raise v.type_error(f"{where}.function.parameters", "a JSON schema object", parameters, param="tools")
    if parameters.get("type", "object") != "object":   # arguments are a JSON object, as OpenAI requires
        raise bad_request(f"{where}.function.parameters must be a schema of type 'object', got type "
                          f"{parameters.get('type')!r}", param="tools")
    v.check_json_schema(parameters, f"{where}.function.parameters", "tools")
    return Tool(name, description, parameters)


# ---- a forced reply ---------------------------------------------------------------------------------------

def _call_from_object(value: Any, names: set[str], new_id: NewId) -> ToolCall | None:
    """{"name": one of `names`, "arguments": an object or its JSON text} -> a call."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def calls_from_values(values: Any, names: set[str], new_id: NewId) -> list[ToolCall]:
    """All of `values` as calls, or [] if any one is not a call to a known function (the reply is then text)."""
    calls = [_call_from_object(value, names, new_id) for value in values]
    return [] if not calls or None in calls else calls  # type: ignore[return-value]


def _calls_from_json(text: str, names: set[str], new_id: NewId) -> list[ToolCall]:
    """A forced reply: a JSON array of calls. One cut short by max_tokens keeps the calls it wrote whole, then the
    call it was writing if its name is complete (with the arguments as far as they got, as OpenAI returns a
    call cut by max_tokens)."""
    value = loads(text)
    if value is not None:
        return calls_from_values(value if isinstance(value, list) else [value], names, new_id)
    items, rest = _whole_items(text)
    calls = calls_from_values(items, names, new_id) if items else []
    if items and not calls:
        return []
    partial = _PARTIAL_CALL_RE.match(rest)
    name = loads(f'"{partial.group(1)}"') if partial else None
    if name in names:
        calls.append(ToolCall(new_id(), name, partial.group(2)))
    return calls


_PARTIAL_CALL_RE = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)$', re.DOTALL)


def _whole_items(text: str) -> tuple[list[Any], str]:
    """The complete elements at the start of a truncated JSON array, and the text after them
    ('[{...}, {...}, {"na' -> two, '{"na')."""
    decoder, items = json.JSONDecoder(), []
    pos = text.find("[") + 1
    if pos == 0:
        return items, text
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return items, text[pos:]
        items.append(item)
