"""The contract of a tool-call format: how a model writes calls into its reply under tool_choice "auto", and how
earlier calls and tool results are written back into a prompt whose chat template does not render tools itself.

One parser instance serves every request (parsers hold no per-request state; streaming state lives in
`ContentSplitter`). A reply that does not parse in full is content, never a partial or guessed call.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from steploop.gateway.text.stop_strings import held_suffix_len


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text, as OpenAI returns it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


NewId = Callable[[], str]


class ToolParser(ABC):
    """A tool-call format. Subclasses set `name` (the --tool-call-parser value) and `start` (the marker that begins
    the calls: content streams until it, calls come whole at the end)."""
    name: ClassVar[str]
    start: ClassVar[str]
    # The marker is a special token: the detokenizer must keep special tokens for the parser to see it (vLLM's
    # mistral parser sets skip_special_tokens=False for the same reason).
    needs_special_tokens: ClassVar[bool] = False

    def parse(self, text: str, names: set[str], new_id: NewId) -> tuple[str | None, list[ToolCall]]:
        """The whole reply -> (content before the calls, calls). Not all calls to known functions: (text, [])."""
        start = self.find_start(text)
        values = self.call_values(text[start:]) if start >= 0 else None
        calls = calls_from_values(values, names, new_id) if values else []
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    @abstractmethod
    def call_values(self, calls_text: str) -> list[Any] | None:
        """The reply from where its calls begin -> the call objects it holds; None if it holds anything else."""

    @abstractmethod
    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """The system prompt that teaches the format, for templates that do not render `tools` (OpenAI tool specs)."""

    @abstractmethod
    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        """An assistant turn's earlier calls ({"name", "arguments": object}) as the model would have written them."""

    def render_result(self, content: str) -> str:
        """A `tool` message's content, as the user turn that carries it to a template without tool support."""
        return f"The function returned:\n{content}"

    def find_start(self, text: str, since: int = 0) -> int:
        """Where the calls begin in `text` (searching from `since`), or -1."""
        return text.find(self.start, since)

    def held_len(self, text: str) -> int:
        """How much of the end of `text` may still turn out to begin the calls (it waits for the next delta)."""
        return held_suffix_len(text, (self.start,))

    def new_call_id(self) -> str:
        return openai_call_id()

    def template_call_id(self, call_id: str) -> str:
        """A client's call id as this format's templates accept it (Mistral's refuse all but 9 alphanumerics)."""
        return call_id


# ---- JSON helpers the formats share ------------------------------------------------------------------------------

def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_from_object(value: Any, names: set[str], new_id: NewId) -> ToolCall | None:
    """{"name": one of `names`, "arguments" (or Llama's "parameters"): an object or its JSON text} -> a call."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def calls_from_values(values: Sequence[Any], names: set[str], new_id: NewId) -> list[ToolCall]:
    """All of `values` as calls, or [] if any one is not a call to a known function (the reply is then text)."""
    calls = [call_from_object(value, names, new_id) for value in values]
    return [] if not calls or None in calls else calls  # type: ignore[return-value]


def listing(tools: Sequence[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
