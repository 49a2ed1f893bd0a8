"""gpt-oss's calls in OpenAI's harmony format (vLLM's `--tool-call-parser openai`). A reply is messages, each a
header then `<|message|>` and a body; a call is a message to `functions.NAME`, its body the JSON arguments:

    <|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The framing (headers and `<|end|>`, `<|return|>`, `<|call|>`) is neither content nor call: the bodies of the other
messages are the content (with --reasoning-parser openai_gptoss the analysis channel is reasoning instead and never
reaches this parser). The markers are special tokens, kept when detokenizing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from steploop.gateway.text.stop_strings import held_suffix_len
from steploop.gateway.tool_parsers.base import Block, CallText, Schemas, ToolParser, listing

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
BODY_ENDS = (CALL, END, RETURN, START)
_BLOCK = re.compile("|".join(re.escape(m) for m in (START, CHANNEL, END, RETURN, CALL)))
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_LONGEST_HEADER = 512


class OpenAIHarmonyParser(ToolParser):
    name = "openai"
    markers = (START, CHANNEL, MESSAGE, END, RETURN, CALL, "<|constrain|>")
    needs_special_tokens = True

    def find_block(self, text: str, pos: int) -> int:
        match = _BLOCK.search(text, pos)
        return match.start() if match else -1

    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        for marker in (END, RETURN, CALL):
            if text.startswith(marker, start):
                return Block("skip", start + len(marker))
        body = text.find(MESSAGE, start)
        if body < 0:
            return Block("pending") if len(text) - start < _LONGEST_HEADER else Block("content", start + 1)
        recipient = _RECIPIENT.search(text, start, body)
        if recipient is None:
            return Block("skip", body + len(MESSAGE))          # a message to the user: its body is content
        body += len(MESSAGE)
        name = recipient.group(1).removeprefix("functions.")
        end = min((e for e in (text.find(m, body) for m in BODY_ENDS) if e >= 0), default=-1)
        if not recipient.group(1).startswith("functions.") or name not in tools:
            return Block("content", None if end < 0 else end)  # a built-in tool's message is content
        if end < 0:
            args = text[body:]
            args = args[:len(args) - (0 if final else held_suffix_len(args, BODY_ENDS))]
            return Block("calls", None, [CallText(name, args, False)])
        closing = next(m for m in BODY_ENDS if text.startswith(m, end))
        return Block("calls", end + (len(closing) if closing != START else 0), [CallText(name, text[body:end], True)])

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\n## functions\n\nThe functions you can call, in JSON:\n"
                f"{listing(tools)}\n\nTo call one, write a message on the commentary channel to "
                f"functions.<name>: {CHANNEL}commentary to=functions.<name> <|constrain|>json{MESSAGE}"
                f"<arguments-object>{CALL}")

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{c['name']} <|constrain|>json{MESSAGE}"
                       f"{json.dumps(c['arguments'], ensure_ascii=False)}{CALL}" for c in calls)

    def render_result(self, content: str) -> str:
        return content
