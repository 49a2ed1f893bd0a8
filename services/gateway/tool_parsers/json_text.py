"""JSON read as it arrives: where a value that may still be cut ends, the fields of a partly written object, and
`JsonNormalizer`, which writes arguments the way `json.dumps` would while they stream.

A streamed call's arguments must add up to exactly what the whole reply returns, however the text was cut into
deltas. Both ways read the model's raw JSON through one JsonNormalizer, which only writes what can no longer change
(a number waits for the character after it), so every delta size gives the same text.
"""

from __future__ import annotations

import json
import re

# Possessive: a string still being written fails in one pass instead of backtracking through it.
_STRING_RE = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
# A string token, closed (group 1 set) or running to the end of the text; or a bracket.
_STRUCTURE_RE = re.compile(r'"(?:[^"\\]++|\\.)*+(?:(")|\\?\Z)|[{}\[\]]', re.DOTALL)
_SPACE_RE = re.compile(r"\s*")
_SCALAR_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_SCALAR_RUN_RE = re.compile(r"[-+.0-9A-Za-z]+")
_PLAIN_RE = re.compile(r'[^"\\\x00-\x1f]+')
_HEX4_RE = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def skip_space(text: str, pos: int) -> int:
    return _SPACE_RE.match(text, pos).end()   # type: ignore[union-attr]


def value_end(text: str, pos: int) -> int | None:
    """The end of the JSON value that starts at `pos` (after any space), or None while it is cut short. Only its
    outline is checked (strings, brackets, scalars), which is all a scan needs to find where a call ends."""
    pos = skip_space(text, pos)
    if pos >= len(text):
        return None
    if text[pos] not in "{[":
        if text[pos] == '"':
            match = _STRING_RE.match(text, pos)
            return match.end() if match else None
        match = _SCALAR_RE.match(text, pos)
        if match is None or match.end() == len(text):   # "12" may still become "123"
            return None
        return match.end()
    depth = 0
    for match in _STRUCTURE_RE.finditer(text, pos):
        ch = match.group()
        if ch[0] == '"':
            if match.group(1) is None:
                return None                    # a string still open at the end of the text
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def read_string(text: str, pos: int) -> tuple[str | None, int]:
    """The JSON string at `pos` (after any space): (its value, its end), or (None, pos) while cut or not a string."""
    start = skip_space(text, pos)
    match = _STRING_RE.match(text, start)
    if match is None:
        return None, pos
    try:
        return json.loads(match.group()), match.end()
    except ValueError:
        return None, pos


def object_fields(text: str, pos: int) -> tuple[dict[str, tuple[int, int | None]], int | None, bool]:
    """A JSON object (perhaps cut short) at `pos`: ({key: (value start, value end or None if cut)}, the object's
    end or None, whether what was read so far is a well-formed object outline)."""
    fields: dict[str, tuple[int, int | None]] = {}
    pos = skip_space(text, pos)
    if pos >= len(text):
        return fields, None, True
    if text[pos] != "{":
        return fields, None, False
    pos = skip_space(text, pos + 1)
    if text.startswith("}", pos):
        return fields, pos + 1, True
    while True:
        key, after = read_string(text, pos)
        if key is None:
            return fields, None, _could_be_string(text, pos)
        colon = skip_space(text, after)
        if colon >= len(text):
            return fields, None, True
        if text[colon] != ":":
            return fields, None, False
        start = skip_space(text, colon + 1)
        end = value_end(text, start)
        fields[key] = (start, end)
        if end is None:
            return fields, None, True
        pos = skip_space(text, end)
        if pos >= len(text):
            return fields, None, True
        if text[pos] == "}":
            return fields, pos + 1, True
        if text[pos] != ",":
            return fields, None, False
        pos = skip_space(text, pos + 1)


def _could_be_string(text: str, pos: int) -> bool:
    pos = skip_space(text, pos)
    return pos >= len(text) or (text[pos] == '"' and _STRING_RE.match(text, pos) is None)


class JsonNormalizer:
    """Raw JSON text, fed as it grows -> the same value written as `json.dumps(value, ensure_ascii=False)` writes
    it (", " and ": " separators, numbers as Python reprints them), in pieces. Text after an error is ignored, so a
    call cut mid-way keeps the arguments as far as they were well-formed."""

    def __init__(self) -> None:
        self.raw = ""
        self.pos = 0
        self.stack: list[str] = []     # open containers: "{" or "["
        self.expect = "value"          # value | key | colon | comma | string | done | error
        self.in_key = False            # the open string is an object key
        self.out: list[str] = []
        self.empty = True              # the innermost container has no item yet

    def feed_to(self, raw: str) -> str:
        """`raw`: the whole arguments text so far (it extends what was fed before). Returns the new output."""
        self.raw = raw
        return self._run(final=False)

    def finish(self) -> str:
        return self._run(final=True)

    @property
    def text(self) -> str:
        return "".join(self.out)

    def _run(self, final: bool) -> str:
        start = len(self.out)
        raw = self.raw
        while self.pos < len(raw) and self.expect not in ("done", "error"):
            if self.expect == "string":
                if not self._string(raw):
                    break
                continue
            pos = skip_space(raw, self.pos)
            if pos >= len(raw):
                self.pos = pos
                break
            self.pos = pos
            if not self._token(raw, raw[pos], final):
                break
        return "".join(self.out[start:])

    def _token(self, raw: str, ch: str, final: bool) -> bool:
        """One structural token at self.pos; False to wait for more text."""
        if self.expect == "colon":
            return self._punct(":", ": ", "value") if ch == ":" else self._fail()
        if self.expect == "comma":
            if ch == ",":
                return self._punct(",", ", ", "key" if self.stack[-1] == "{" else "value")
            if ch == ("}" if self.stack[-1] == "{" else "]"):
                return self._close(ch)
            return self._fail()
        if self.expect == "key":
            if ch == '"':
                return self._open_string(key=True)
            if ch == "}" and self.empty:
                return self._close(ch)
            return self._fail()
        # a value
        if ch in "{[":
            self.stack.append(ch)
            self.out.append(ch)
            self.pos += 1
            self.empty = True
            self.expect = "key" if ch == "{" else "value"
            return True
        if ch == "]" and self.empty and self.stack and self.stack[-1] == "[":
            return self._close(ch)
        if ch == '"':
            return self._open_string(key=False)
        run = _SCALAR_RUN_RE.match(raw, self.pos)   # a scalar ends at the first character that cannot extend it
        if run is None:
            return self._fail()
        if run.end() == len(raw) and not final:
            return False
        if not _SCALAR_RE.fullmatch(run.group()):
            return self._fail()
        self.out.append(json.dumps(json.loads(run.group())))
        self.pos = run.end()
        self._after_value()
        return True

    def _punct(self, ch: str, written: str, then: str) -> bool:
        self.out.append(written)
        self.pos += 1
        self.expect = then
        self.empty = False
        return True

    def _open_string(self, key: bool) -> bool:
        self.out.append('"')
        self.pos += 1
        self.expect, self.in_key = "string", key
        return True

    def _close(self, ch: str) -> bool:
        self.stack.pop()
        self.out.append(ch)
        self.pos += 1
        self._after_value()
        return True

    def _after_value(self) -> None:
        self.empty = False
        self.expect = "done" if not self.stack else "comma"

    def _fail(self) -> bool:
        self.expect = "error"
        return False

    def _string(self, raw: str) -> bool:
        """Inside a string: copy plain runs, decode escapes; False to wait for more text."""
        plain = _PLAIN_RE.match(raw, self.pos)
        if plain:
            self.out.append(plain.group())
            self.pos = plain.end()
            return True
        ch = raw[self.pos]
        if ch == '"':
            self.out.append('"')
            self.pos += 1
            if self.in_key:
                self.expect = "colon"
            else:
                self._after_value()
            return True
        if ch != "\\":
            return self._fail()                      # a raw control character: not JSON
        if self.pos + 1 >= len(raw):
            return False
        kind = raw[self.pos + 1]
        if kind in _ESCAPES:
            self.out.append(json.dumps(_ESCAPES[kind], ensure_ascii=False)[1:-1])
            self.pos += 2
            return True
        if kind != "u":
            return self._fail()
        return self._unicode(raw)

    def _unicode(self, raw: str) -> bool:
        hex1 = raw[self.pos + 2:self.pos + 6]
        if len(hex1) < 4:
            return False if _HEX4_RE.match(hex1.ljust(4, "0")) else self._fail()
        if not _HEX4_RE.fullmatch(hex1):
            return self._fail()
        code = int(hex1, 16)
        if 0xD800 <= code < 0xDC00:                  # a surrogate pair is one character
            low = raw[self.pos + 6:self.pos + 12]
            if len(low) < 6 and "\\u".startswith(low[:2]) and _HEX4_RE.match(low[2:].ljust(4, "0")):
                return False
            hex2 = low[2:]
            low_code = int(hex2, 16) if low.startswith("\\u") and _HEX4_RE.fullmatch(hex2) else -1
            if 0xDC00 <= low_code < 0xE000:
                self.out.append(chr(0x10000 + ((code - 0xD800) << 10) + low_code - 0xDC00))
                self.pos += 12
                return True
        if 0xD800 <= code < 0xE000:
            self.out.append(f"\\u{code:04x}")         # a lone surrogate stays escaped: it has no UTF-8
        else:
            self.out.append(json.dumps(chr(code), ensure_ascii=False)[1:-1])
        self.pos += 6
        return True


def normalized(raw: str) -> str:
    """The whole of `raw` through a JsonNormalizer."""
    norm = JsonNormalizer()
    return norm.feed_to(raw) + norm.finish()
