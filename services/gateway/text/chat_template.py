"""The prompt of a chat request: the conversation, and the tools it may call, rendered by the model's chat template.

Templates that know tools (their source uses `tools`) get the tool list, assistant `tool_calls` (arguments as
objects) and `tool` messages as HF chat templates expect them. Other templates (SmolLM2's) get the tool list as a
system message in the `--tool-call-parser`'s format, earlier calls written as that format writes them, and tool
results as user turns. The tokenizer only ever sees the rendered messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from steploop.gateway.errors import bad_request
from steploop.gateway.text.tokenizer import Tokenizer
from steploop.gateway.tool_parsers import ToolParser
from steploop.gateway.tool_parsers.tools import ToolRequest


class ChatTemplate:
    """Renders chat requests into prompt token ids (chat completions and /tokenize share it)."""

    def __init__(self, tokenizer: Tokenizer, parser: ToolParser) -> None:
        self.tokenizer = tokenizer
        self.parser = parser      # how tools and earlier calls are written for templates that do not render them

    @property
    def knows_tools(self) -> bool:
        template = self.tokenizer.chat_template
        return isinstance(template, str) and "tools" in template

    async def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool,
                     continue_final_message: bool, tools: ToolRequest | None,
                     template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The prompt's token ids; a template that cannot render the conversation is a 400 naming `messages`.
        template_kwargs: extra template variables (chat_template_kwargs, checked by protocol.py)."""
        rendered, tool_specs = for_template(list(messages), tools, self.parser, self.knows_tools)
        try:
            return await self.tokenizer.apply_chat_template(
                rendered, tools=tool_specs, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as err:   # no template, the template refused
            # (raise_exception), or it could not use a chat_template_kwargs value
            raise bad_request(f"cannot apply the chat template: {err}", param="messages") from None


def for_template(messages: list[dict[str, Any]], request: ToolRequest | None, parser: ToolParser,
                 native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument to render. `native`: the template itself renders tools, tool calls and
    tool messages (then calls' arguments are given as objects, as HF templates expect)."""
    tools = [t.to_openai() for t in request.tools] if request is not None else None
    if native:
        return [_native_message(m, parser) for m in messages], tools
    out = [_plain_message(m, parser) for m in messages]
    if tools is not None:
        prompt = parser.instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native_message(message: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    if message["role"] == "tool":
        return {**message, "tool_call_id": parser.template_call_id(message["tool_call_id"])}
    if not message.get("tool_calls"):
        return message
    calls = [{"id": parser.template_call_id(c["id"]), "type": "function",
              "function": {"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _plain_message(message: dict[str, Any], parser: ToolParser) -> dict[str, str]:
    if message["role"] == "tool":
        return {"role": "user", "content": parser.render_result(message["content"])}
    text = message["content"]
    if message.get("tool_calls"):
        calls = parser.render_calls([{"name": c["function"]["name"],
                                      "arguments": _arguments_object(c["function"]["arguments"])}
                                     for c in message["tool_calls"]])
        text = f"{text}\n{calls}" if text else calls
    return {"role": message["role"], "content": text}


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments    # a client's malformed arguments are rendered as the text they were
