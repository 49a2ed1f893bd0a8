"""Tool-call formats, keyed by name as vLLM's `--tool-call-parser`: how a model writes calls under tool_choice
"auto", parsed whole (`ToolParser.parse`) or streamed (`ContentSplitter`).

A new format is a `ToolParser` subclass in its own module, listed in `_PARSERS`. The request side (`tools` and
`tool_choice`: what may be called, and how) is tools.py.
"""

from __future__ import annotations

from steploop.gateway.tool_parsers.base import ToolCall, ToolParser
from steploop.gateway.tool_parsers.hermes import HermesParser
from steploop.gateway.tool_parsers.llama3_json import Llama3JsonParser
from steploop.gateway.tool_parsers.mistral import MistralParser
from steploop.gateway.tool_parsers.stream import ContentSplitter

__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "ContentSplitter", "ToolCall", "ToolParser", "get_tool_parser"]

_PARSERS: tuple[type[ToolParser], ...] = (HermesParser, MistralParser, Llama3JsonParser)
TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in _PARSERS}
DEFAULT_TOOL_PARSER = HermesParser.name


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; an unknown name is a ValueError listing the known ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}") from None
