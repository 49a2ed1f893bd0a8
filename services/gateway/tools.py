"""Tool calling for /v1/chat/completions: OpenAI's `tools` / `tool_choice`, as vLLM serves them.

- `tool_choice` "none" (or no tools): the tools are left out of the prompt and the reply is plain text.
- "auto" (the default when tools are given): the model sees the tools and may answer with calls written in the
  Hermes format that Qwen, Hermes and most open tool-tuned models use,
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
  which the gateway turns into `message.tool_calls` (finish_reason "tool_calls"); text before the first call is
  the message's content. Text that does not parse stays content.
- "required" and a named function: the reply is constrained by the worker's structured output (xgrammar) to a
  JSON array of calls to the given tools, or to the named function's arguments, so it is always well-formed
  whatever the model (as vLLM does with guided decoding).

Templates that know tools (their source uses `tools`) get them, and assistant `tool_calls` / `tool` messages, as
HF chat templates expect them. Other templates (SmolLM2's) get the tool list as a system message in the Hermes
format, earlier calls as `<tool_call>` text and tool results as `<tool_response>` user turns.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway import validation as v
from services.gateway.errors import bad_request
from services.gateway.stop_strings import held_suffix_len

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
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
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text, as OpenAI returns it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked of tools. `choice` is "auto", "required" or "named" ("none" is no ToolRequest)."""
    tools: tuple[Tool, ...]
    choice: str
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
        if self.choice == "named":
            return None, [ToolCall(new_call_id(), self.named or "", text.strip())]
        if self.choice == "required":
            calls = _calls_from_json(text, {t.name for t in self.tools})
            return (None, calls) if calls else (text, [])
        return parse_hermes(text, {t.name for t in self.tools}, self.parallel)


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of a schema whose local refs ("#/...", "#") point into it at `base` of an enclosing document."""
    if isinstance(node, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    return node


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tools(body: dict[str, Any], json_schema: str, json_object: bool) -> ToolRequest | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> a ToolRequest, or None when no tool may be called."""
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
        request = ToolRequest(tools, "auto", parallel=parallel)
    elif choice == "none":
        return None
    elif choice == "required":
        request = ToolRequest(tools, "required", parallel=parallel)
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if name not in names:
            raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools' ({names})",
                              param="tool_choice")
        request = ToolRequest(tools, "named", named=name, parallel=parallel)
    else:
        raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                          param="tool_choice")
    if request.choice != "auto" and (json_schema or json_object):
        raise bad_request("'response_format' cannot be combined with a 'tool_choice' that forces a call (both "
                          "constrain the reply)", param="response_format")
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


# ---- the conversation the template sees ------------------------------------------------------------------------

def tools_system_prompt(tools: tuple[Tool, ...]) -> str:
    listing = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to answer the user. The functions you can call are "
            f"described in JSON inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\nTo call a function, "
            "answer with one JSON object per call, each inside <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')


def for_template(messages: list[dict[str, Any]], request: ToolRequest | None,
                 native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument to render. `native`: the template itself renders tools, tool calls and
    tool messages (then calls' arguments are given as objects, as HF templates expect)."""
    tools = [t.to_openai() for t in request.tools] if request is not None else None
    if native:
        return [_native_message(m) for m in messages], tools
    out = [_plain_message(m) for m in messages]
    if tools is not None:
        prompt = tools_system_prompt(request.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _plain_message(message: dict[str, Any]) -> dict[str, str]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    text = message["content"]
    for call in message.get("tool_calls") or ():
        body = {"name": call["function"]["name"], "arguments": _arguments_object(call["function"]["arguments"])}
        text += f"{chr(10) if text else ''}{CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_CLOSE}"
    return {"role": message["role"], "content": text}


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments    # a client's malformed arguments are rendered as the text they were


# ---- the reply --------------------------------------------------------------------------------------------------

def parse_hermes(text: str, names: set[str], parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """Calls in <tool_call> tags (the last may lack its closing tag when the reply ends there)."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _CALL_RE.finditer(text, start):
        call = _call_from_object(_loads(match.group(1)), names)
        if call is None:
            return text, []       # one unreadable call: hand the whole reply back as text, as vLLM does
        calls.append(call)
    if not parallel:
        calls = calls[:1]
    content = text[:start].strip()
    return content or None, calls


def _calls_from_json(text: str, names: set[str]) -> list[ToolCall]:
    """A forced reply: a JSON array of calls. One cut short by max_tokens keeps the calls it wrote whole, then the
    call it was writing if its name is complete (with the arguments as far as they got, as OpenAI returns a
    call cut by max_tokens)."""
    value = _loads(text)
    if value is not None:
        items = value if isinstance(value, list) else [value]
        calls = [_call_from_object(item, names) for item in items]
        return [] if not calls or None in calls else calls
    items, rest = _whole_items(text)
    calls = [_call_from_object(item, names) for item in items]
    if None in calls:
        return []
    partial = _PARTIAL_CALL_RE.match(rest)
    name = _loads(f'"{partial.group(1)}"') if partial else None
    if name in names:
        calls.append(ToolCall(new_call_id(), name, partial.group(2)))
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


def _call_from_object(value: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ContentSplitter:
    """Streaming under tool_choice "auto": text is content until a <tool_call> tag begins; from there it is held
    back (the calls are parsed from the whole reply at its end). A suffix that may be the start of the tag waits
    for the next delta, as stop strings do."""

    def __init__(self) -> None:
        self.text = ""          # the whole reply so far
        self._emitted = 0
        self.in_calls = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_calls:
            return ""
        tag = self.text.find(CALL_OPEN, self._emitted)
        if tag >= 0:
            self.in_calls = True
            end = tag
        else:
            end = len(self.text) - held_suffix_len(self.text, (CALL_OPEN,))
        out, self._emitted = self.text[self._emitted:end], max(end, self._emitted)
        return out

    def held(self) -> str:
        """What was not emitted: the calls, or the end of a reply that stopped on "<tool"."""
        return self.text[self._emitted:]

