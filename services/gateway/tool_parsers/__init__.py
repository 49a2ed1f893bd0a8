"""Tool-call formats, keyed by name as vLLM's `--tool-call-parser`: how a model writes calls under tool_choice
"auto", read whole or streamed by the same `CallSplitter` (stream.py) over the format's `scan` (base.py).

A new format is a `ToolParser` subclass in its own module, listed in `_PARSERS`, and a case in the conformance
suite (tests/gateway/test_tool_parser_conformance.py). The request side (`tools` and `tool_choice`: what may be
called, and how) is tools.py.
"""

from __future__ import annotations

from steploop.gateway.tool_parsers.base import ToolCall, ToolParser
from steploop.gateway.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from steploop.gateway.tool_parsers.glm45 import Glm45Parser
from steploop.gateway.tool_parsers.granite import GraniteParser
from steploop.gateway.tool_parsers.hermes import HermesParser
from steploop.gateway.tool_parsers.kimi_k2 import KimiK2Parser
from steploop.gateway.tool_parsers.llama3_json import Llama3JsonParser
from steploop.gateway.tool_parsers.mistral import MistralParser
from steploop.gateway.tool_parsers.openai_harmony import OpenAIHarmonyParser
from steploop.gateway.tool_parsers.pythonic import PythonicParser
from steploop.gateway.tool_parsers.qwen3_coder import Qwen3CoderParser
from steploop.gateway.tool_parsers.stream import CallSplitter, split_whole

__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "CallSplitter", "ToolCall", "ToolParser", "get_tool_parser",
           "split_whole"]

_PARSERS: tuple[type[ToolParser], ...] = (HermesParser, MistralParser, Llama3JsonParser, Qwen3CoderParser,
                                          PythonicParser, DeepSeekV3Parser, KimiK2Parser, Glm45Parser,
                                          GraniteParser, OpenAIHarmonyParser)
TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in _PARSERS}
DEFAULT_TOOL_PARSER = HermesParser.name


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; an unknown name is a ValueError listing the known ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}") from None
