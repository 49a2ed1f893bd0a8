"""The contract of a tool-call format: how a model writes calls into its reply under tool_choice "auto", and how
earlier calls and tool results are written back into a prompt whose chat template does not render tools itself.

A format is read by `scan(text, final)`: the reply so far -> its segments in order, content text and calls, of which
only what can no longer change is reported. One scan serves both ways a reply is read: whole (final=True once) and
streamed (after every delta, then final=True); stream.py turns the growth between scans into OpenAI's deltas. So a
reply gives the same content and calls however it was cut into deltas, which tests/gateway's conformance suite checks
for every format.

The rules every format keeps:
  - A call starts once its name is complete and names a given tool; from then it is a call, and its arguments
    stream as written (a call cut short keeps its arguments as far as they were well-formed JSON, as OpenAI returns
    a call cut by max_tokens). A block that names no given tool, or is not the format, is content.
  - Whitespace right before a call and right after one belongs to neither; all other text is content, in order.
  - While streaming, content that may still begin a marker, or trailing whitespace, waits for the next delta.

One parser instance serves every request (parsers hold no per-request state).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from steploop.gateway.text.stop_strings import held_suffix_len
from steploop.gateway.tool_parsers import json_text

Schemas = Mapping[str, Mapping[str, Any]]   # the given tools: name -> its parameters' JSON schema


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text, as OpenAI returns it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallText:
    """A call as far as the reply has written it."""
    name: str
    arguments: str          # its arguments as JSON text so far (the model's own, or the format's rewritten as JSON)
    done: bool              # its text is complete
    id: str = ""            # the id the format itself writes (Kimi K2's `functions.NAME:0`); "": the gateway makes one


Segment = str | CallText


@dataclass
class Block:
    """What a format reads at one of its markers. kind: "calls" (calls, then more of the block unless `end` is
    set), "pending" (cannot tell yet), "content" (not a call: the text up to `end` is content; None: not known yet),
    "skip" (framing that is neither, up to `end`)."""
    kind: str
    end: int | None = None
    calls: list[CallText] = field(default_factory=list)


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


NewId = Callable[[], str]


class ToolParser(ABC):
    """A tool-call format. Subclasses set `name` (the --tool-call-parser value) and `markers` (the first one begins
    a block of calls; all of them are held back while streaming until they are complete), and read a block at a
    marker in `read_block`."""
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    # The markers are special tokens: the detokenizer must keep special tokens for the parser to see them (vLLM's
    # mistral parser sets skip_special_tokens=False for the same reason).
    needs_special_tokens: ClassVar[bool] = False

    def scan(self, text: str, final: bool, tools: Schemas) -> list[Segment]:
        """The reply so far -> [content, call, content, call, ..., content] (content may be ""), as far as decided."""
        out: list[Segment] = []
        cur, pos, after_call = "", 0, False
        while True:
            start = self.find_block(text, pos)
            piece = text[pos:start if start >= 0 else len(text)]
            cur += piece.lstrip() if after_call and not cur else piece
            if start < 0:
                if not final:
                    cur = cur[:len(cur) - held_suffix_len(cur, self.markers)].rstrip()
                break
            block = self.read_block(text, start, final, tools)
            if block.kind == "skip":
                pos = block.end  # type: ignore[assignment]
                continue
            if block.kind == "content" and block.end is not None:
                cur, pos, after_call = cur + text[start:block.end], block.end, False
                continue
            if block.kind != "calls":           # pending, or content whose end is not known yet
                cur = cur + text[start:] if final else cur.rstrip()
                break
            for call in block.calls:
                out += [cur.rstrip(), call]
                cur = ""
            if block.end is None:
                break
            pos, after_call = block.end, True
        return [*out, cur]

    def find_block(self, text: str, pos: int) -> int:
        """Where the next block begins at or after `pos`, or -1."""
        return text.find(self.markers[0], pos)

    @abstractmethod
    def read_block(self, text: str, start: int, final: bool, tools: Schemas) -> Block:
        """The block at `start` (where find_block found it)."""

    @abstractmethod
    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """The system prompt that teaches the format, for templates that do not render `tools` (OpenAI tool specs)."""

    @abstractmethod
    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        """An assistant turn's earlier calls ({"name", "arguments": object}) as the model would have written them."""

    def render_result(self, content: str) -> str:
        """A `tool` message's content, as the user turn that carries it to a template without tool support."""
        return f"The function returned:\n{content}"

    def new_call_id(self) -> str:
        return openai_call_id()

    def template_call_id(self, call_id: str) -> str:
        """A client's call id as this format's templates accept it (Mistral's refuse all but 9 alphanumerics)."""
        return call_id


# ---- helpers the formats share ------------------------------------------------------------------------------------

def held_prefix(text: str, pos: int, marker: str) -> bool:
    """Whether text[pos:] is a proper beginning of `marker` (the rest may still arrive)."""
    rest = text[pos:]
    return len(rest) < len(marker) and marker.startswith(rest)


def read_json_call(text: str, pos: int, tools: Schemas, args_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> tuple[str, CallText | None, int | None]:
    """A {"name": ..., "arguments": {...}} object at `pos` -> (state, call, end). state: "call" (the name is a given
    tool; end: None while the object is open), "pending" (no name yet), "content" (not such a call)."""
    fields, end, well_formed = json_text.object_fields(text, pos)
    if not well_formed:
        return "content", None, None
    name_span = fields.get("name")
    if name_span is None or name_span[1] is None:
        return ("content" if end is not None else "pending"), None, None
    name = loads(text[name_span[0]:name_span[1]])
    if not isinstance(name, str) or name not in tools:
        return "content", None, None
    args_key = next((k for k in args_keys if k in fields), None)
    if args_key is None:
        return "call", CallText(name, "{}" if end is not None else "", end is not None), end
    a_start, a_end = fields[args_key]
    raw = text[a_start:a_end if a_end is not None else len(text)]
    if raw.startswith('"'):     # the arguments as a JSON string of JSON (some models write them so): read it whole
        decoded = loads(raw) if a_end is not None else None
        raw = decoded if isinstance(decoded, str) else ""
    return "call", CallText(name, raw, end is not None), end


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def listing(tools: Sequence[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
