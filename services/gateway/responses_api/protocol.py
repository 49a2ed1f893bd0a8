"""The Responses request body, read into what the chat-completions flow takes.

    input               a string (one user message) or items: messages ({"role", "content": str | input_text /
                        output_text parts, and input_image parts in user messages}, with or without "type":
                        "message"), function_call, function_call_output;
                        reasoning items of earlier turns are dropped
    instructions        a system message before the input (not carried over by previous_response_id, as OpenAI)
    max_output_tokens, temperature, top_p, top_k (vLLM's extra), stream, store (default true, as OpenAI's: see store.py),
    previous_response_id, tools (function tools), tool_choice, parallel_tool_calls, text.format (text /
    json_object / json_schema), cache_salt (vLLM's extra); metadata and user are kept on the response.
Built-in tools (web search, file search, computer use) and files are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from steploop.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v
from steploop.gateway.media.parts import responses_image_part, user_content
from steploop.gateway.openai_api.protocol import SamplingFields
from steploop.gateway.tool_parsers import ToolParser
from steploop.gateway.tool_parsers.tools import ToolRequest, parse_tools

_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ResponsesRequest:
    model: str | None
    items: tuple[dict[str, Any], ...]      # this request's input as chat messages (without instructions)
    instructions: str | None
    sampling: SamplingFields
    tools: ToolRequest | None
    previous_response_id: str | None
    store: bool
    echo: dict[str, Any]                   # request fields the Response object repeats back


def _content(content: Any, where: str, role: str) -> str | list[dict[str, Any]]:
    """A message's text; a user message with input_image parts: its parts in the shared form (media/parts.py)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise v.type_error(f"{where}.content", "a string or an array of text parts", content, param="input")
    parts = []
    for i, part in enumerate(content):
        at = f"{where}.content[{i}]"
        if role == "user" and isinstance(part, dict) and part.get("type") == "input_image":
            parts.append({"type": "image", "image": responses_image_part(part, at)})
            continue
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            allowed = "input_text / output_text / input_image part" if role == "user" else \
                "input_text / output_text part (input_image only in user messages)"
            raise bad_request(f"{at} must be an {allowed}; files are not supported", param="input")
        parts.append({"type": "text", "text": part["text"]})
    return user_content(parts)


def parse_input(value: Any) -> list[dict[str, Any]]:
    """`input` -> chat messages; function_calls after an assistant message (or each other) join its turn, as chat
    completions writes one assistant message with text and tool_calls."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array of items", param="input",
                          code="missing_required_parameter" if value is None else "invalid_value")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise v.type_error(where, "an object", item, param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                got = "is missing" if "role" not in item else f"is {role!r}"
                raise bad_request(f"{where}.role {got}; it must be user, assistant, system or developer",
                                  param="input", code="missing_required_parameter" if "role" not in item
                                  else "invalid_value")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(item.get("content"), where, role)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise bad_request(f"{where} must be {{'type': 'function_call', 'call_id', 'name': str, "
                                  "'arguments': str}", param="input")
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise v.type_error(f"{where}.call_id", "a string", item.get("call_id"), param="input")
            text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind != "reasoning":
            raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", param="input")
    if not out:
        raise bad_request("'input' has no message, function_call or function_call_output item", param="input")
    return out


def _openai_tools(body: dict[str, Any]) -> dict[str, Any]:
    """Responses' flat function tools ({"type": "function", "name", ...}) in chat completions' nested form."""
    raw = body.get("tools")
    out: dict[str, Any] = {"tool_choice": body.get("tool_choice"),
                           "parallel_tool_calls": body.get("parallel_tool_calls")}
    if raw is None:
        return out
    if not isinstance(raw, list):
        raise v.type_error("tools", "an array of tools", raw)
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(f"tools[{i}] must be a function tool; built-in tools ({kind!r}) are not supported",
                              param="tools")
        tools.append({"type": "function", "function": {k: tool.get(k) for k in ("name", "description", "parameters")}})
    choice = out["tool_choice"]
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    return {**out, "tools": tools}


def _text_format(body: dict[str, Any]) -> tuple[str, bool, dict[str, Any]]:
    """text.format -> (json_schema text, json_object, the format as echoed)."""
    fmt = v.get_object(v.get_object(body, "text"), "format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return "", False, fmt
    if kind == "json_object":
        return "", True, fmt
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("'text.format.schema' must be a JSON schema object", param="text")
        v.check_json_schema(schema, "text.format.schema", "text")
        return json.dumps(schema), False, fmt
    raise bad_request(f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="text")


def parse_responses(body: Any, parser: ToolParser, defaults: GenerationDefaults = NO_DEFAULTS) -> ResponsesRequest:
    body = v.require_object(body)
    items = parse_input(body.get("input"))
    instructions = v.get_str(body, "instructions")
    json_schema, json_object, fmt = _text_format(body)
    # (the error names chat's field, as it always has, not text.format)
    tools = parse_tools(_openai_tools(body), "response_format" if json_schema or json_object else "", parser)
    sampling = SamplingFields(
        max_tokens=v.get_int(body, "max_output_tokens", None, lo=1, hi=v.MAX_UINT32),
        temperature=v.get_number(body, "temperature", defaults.get("temperature", 1.0), lo=0.0, hi=2.0),
        top_p=v.get_number(body, "top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0, lo_exclusive=True),
        top_k=v.get_int(body, "top_k", defaults.get("top_k", 0), lo=-1, hi=v.MAX_INT32),
        min_p=defaults.get("min_p", 0.0), seed=v.get_int(body, "seed", None, lo=0, hi=2**64 - 1),
        presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=defaults.get("repetition_penalty", 1.0), n=1,
        stop=(), stop_token_ids=(), ignore_eos=False,
        min_tokens=0, include_stop_str_in_output=False, skip_special_tokens=True,
        stream=v.get_bool(body, "stream", False), include_usage=False,
        json_schema=json_schema, json_object=json_object, cache_salt=v.get_str(body, "cache_salt", "") or "",
        constrained_by="text.format" if json_schema or json_object else "")
    forced = tools.guided_schema() if tools is not None else ""
    if forced:
        sampling = replace(sampling, json_schema=forced)
    elif tools is not None and parser.needs_special_tokens:   # its marker must survive detokenizing (mistral)
        sampling = replace(sampling, skip_special_tokens=False)
    echo = {"instructions": instructions, "max_output_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "text": {"format": fmt}, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": v.get_bool(body, "parallel_tool_calls", True),
            "metadata": v.get_object(body, "metadata"), "user": v.get_str(body, "user")}
    return ResponsesRequest(v.get_str(body, "model"), tuple(items), instructions, sampling, tools,
                            v.get_str(body, "previous_response_id"), v.get_bool(body, "store", True), echo)
