"""Anthropic's Messages request body, read into what the chat-completions flow takes: chat messages for the chat
template, SamplingFields, and a ToolRequest.

    system              a string or text blocks -> the system message
    messages            user / assistant turns; content a string or blocks: text, image (user: base64 or url
                        source, in media/parts.py's shared form), tool_use (assistant),
                        tool_result (user: each becomes a `tool` message, in order); thinking blocks of earlier
                        turns are dropped (chat templates drop earlier reasoning too). A last assistant turn is a
                        prefill: the reply continues it.
    max_tokens          required, >= 1 (as Anthropic)
    stop_sequences, temperature [0, 1], top_p, top_k, stream, cache_salt (vLLM's extra), metadata (ignored)
    tools               [{name, description, input_schema}]; tool_choice auto / any / tool / none, with
                        disable_parallel_tool_use. `any` and `tool` go through the guided-decoding path chat
                        completions' `required` / named function use, so the input always parses.
Documents, images inside a tool_result, and server tools are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from steploop.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v
from steploop.gateway.media.parts import anthropic_image_block, user_content
from steploop.gateway.openai_api.protocol import SamplingFields
from steploop.gateway.tool_parsers import ToolParser
from steploop.gateway.tool_parsers.tools import ToolRequest, parse_tools


@dataclass(frozen=True)
class MessagesRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]   # chat-completions messages (protocol.py's form)
    continue_final_message: bool           # the last turn is the assistant's: a prefill the reply continues
    sampling: SamplingFields
    tools: ToolRequest | None


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (a tool_result's content, the system prompt)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise v.type_error(where, "a string or an array of text blocks", blocks, param="messages")
    texts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{i}] must be a text block {{'type': 'text', 'text': str}}; images are "
                              "taken only as a user turn's own blocks, documents not at all", param="messages")
        texts.append(block["text"])
    return "".join(texts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise v.type_error(f"{where}.content", "a string or an array of content blocks", content, param="messages")
    return content


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Text and image blocks become user messages (images in the shared part form, media/parts.py), each
    tool_result a `tool` message, in the order given."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []      # the user message being gathered

    def flush() -> None:
        if parts:
            out.append({"role": "user", "content": user_content(list(parts))})
            parts.clear()

    for i, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content[{i}]"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise v.type_error(f"{at}.text", "a string", block.get("text"), param="messages")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image", "image": anthropic_image_block(block, at)})
        elif kind == "tool_result":
            flush()
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise v.type_error(f"{at}.tool_use_id", "a string", call_id, param="messages")
            text = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _unsupported_block(kind, at, "user")
    flush()
    return out


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for i, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content[{i}]"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise v.type_error(f"{at}.text", "a string", block.get("text"), param="messages")
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise bad_request(f"{at} must be {{'type': 'tool_use', 'id': str, 'name': str, 'input': object}}",
                                  param="messages")
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise _unsupported_block(kind, at, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _unsupported_block(kind: Any, at: str, role: str) -> Exception:
    return bad_request(f"{at} has type {kind!r}, which a {role} turn cannot carry here (supported: text"
                       f"{', image, tool_result' if role == 'user' else ', tool_use, thinking'}; documents are not "
                       "supported)", param="messages")


def parse_conversation(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], bool]:
    """`system` + `messages` -> (chat messages, whether the last assistant turn is a prefill)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array of messages", param="messages",
                          code="missing_required_parameter" if raw is None else "invalid_value")
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant'", param="messages")
        blocks = _blocks(message.get("content"), where)
        if message["role"] == "user":
            out.extend(_user_turn(blocks, where))
        else:
            out.append(_assistant_turn(blocks, where))
    if not any(m["role"] != "system" for m in out):
        raise bad_request("'messages' has no content: every message's content is empty", param="messages")
    prefill = out[-1]["role"] == "assistant"
    if prefill and out[-1].get("tool_calls"):
        raise bad_request("the last message is an assistant turn with tool_use: send the tool_result in a user "
                          "turn after it", param="messages")
    return tuple(out), prefill


def _openai_tools(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's tools and tool_choice in OpenAI's form, for tools.parse_tools (one validation for both)."""
    raw = body.get("tools")
    if raw is None:
        return {"tool_choice": "none" if body.get("tool_choice") is None else _choice(body["tool_choice"])}
    if not isinstance(raw, list):
        raise v.type_error("tools", "an array of tools", raw)
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(f"tools[{i}] must be a custom tool {{'name', 'description', 'input_schema'}}; "
                              f"server tools ({kind!r}) are not supported", param="tools")
        if not isinstance(tool.get("input_schema"), dict):
            raise v.type_error(f"tools[{i}].input_schema", "a JSON schema object", tool.get("input_schema"),
                               param="tools")
        tools.append({"type": "function", "function": {"name": tool.get("name"), "description":
                                                       tool.get("description"), "parameters": tool["input_schema"]}})
    choice = body.get("tool_choice") or {"type": "auto"}
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    return {"tools": tools, "tool_choice": _choice(choice), "parallel_tool_calls": parallel}


def _choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': str}",
                      param="tool_choice")


def parse_tool_request(body: dict[str, Any], parser: ToolParser) -> ToolRequest | None:
    return parse_tools(_openai_tools(body), "", parser)


def _stop_sequences(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop_sequences")
    if value is not None and not isinstance(value, list):
        raise v.type_error("stop_sequences", "an array of strings", value)
    return v.get_stop(body, "stop_sequences")


def parse_messages(body: Any, parser: ToolParser, defaults: GenerationDefaults = NO_DEFAULTS) -> MessagesRequest:
    body = v.require_object(body)
    if body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
    max_tokens = v.get_int(body, "max_tokens", None, lo=1, hi=v.MAX_UINT32)
    messages, prefill = parse_conversation(body)
    tools = parse_tool_request(body, parser)
    v.get_object(body, "metadata")
    sampling = SamplingFields(
        max_tokens=max_tokens,
        temperature=v.get_number(body, "temperature", defaults.get("temperature", 1.0), lo=0.0, hi=1.0),
        top_p=v.get_number(body, "top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0, lo_exclusive=True),
        top_k=v.get_int(body, "top_k", defaults.get("top_k", 0), lo=0, hi=v.MAX_INT32),
        min_p=defaults.get("min_p", 0.0), seed=None, presence_penalty=0.0, frequency_penalty=0.0,
        repetition_penalty=defaults.get("repetition_penalty", 1.0), n=1,
        stop=_stop_sequences(body), stop_token_ids=(), ignore_eos=False, min_tokens=0,
        include_stop_str_in_output=False,
        # auto calls in a format whose marker is a special token (mistral): it must survive detokenizing
        skip_special_tokens=not (tools is not None and tools.choice == "auto" and parser.needs_special_tokens),
        stream=v.get_bool(body, "stream", False), include_usage=False,
        json_schema=tools.guided_schema() if tools is not None else "",   # any / tool: the grammar writes the call
        cache_salt=v.get_str(body, "cache_salt", "") or "")
    return MessagesRequest(v.get_str(body, "model"), messages, prefill, sampling, tools)
