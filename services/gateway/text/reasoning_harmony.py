"""gpt-oss's reasoning in OpenAI's harmony format (`--reasoning-parser openai_gptoss`): a reply is messages, each
a header (`<|start|>assistant`, `<|channel|>NAME`, perhaps ` to=RECIPIENT`) then `<|message|>`, a body, and an end
(`<|end|>`, `<|return|>`, `<|call|>`, or the next `<|start|>`).

    analysis channel            its body is reasoning
    a message to a recipient    kept whole as content, for the tool-call parser (`--tool-call-parser openai`)
    any other message (final)   its body is content
Headers and ends are framing, neither. Text outside any message is content."""

from __future__ import annotations

import re

from steploop.gateway.text.stop_strings import held_suffix_len

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_OUTSIDE = re.compile("|".join(re.escape(m) for m in (START, CHANNEL, *ENDS)))
_RECIPIENT = re.compile(r"\bto=[^\s<]+")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonySplitter:
    def __init__(self) -> None:
        self.buf = ""
        self.state = "outside"     # outside | header | body
        self.kind = "content"      # the body's: reasoning | content | raw (a message to a recipient, kept whole)

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = [], []
        while self.buf:
            if self.state == "outside":
                match = _OUTSIDE.search(self.buf)
                if match is None:
                    hold = 0 if last else held_suffix_len(self.buf, (START, CHANNEL, *ENDS))
                    content.append(self.buf[:len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold:]
                    break
                content.append(self.buf[:match.start()])
                self.buf = self.buf[match.start():]
                if match.group() in ENDS:          # a stray end: framing
                    self.buf = self.buf[match.end() - match.start():]
                else:
                    self.state = "header"
            elif self.state == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    if last:
                        content.append(self.buf)   # a header the reply ended in: what there is, as text
                        self.buf = ""
                    break
                header, self.buf = self.buf[:at], self.buf[at + len(MESSAGE):]
                channel = _CHANNEL_NAME.search(header)
                if _RECIPIENT.search(header):
                    self.kind = "raw"
                    content.append(header + MESSAGE)
                else:
                    self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
                self.state = "body"
            else:
                ends = [(self.buf.find(m), m) for m in (*ENDS, START) if m in self.buf]
                out = reasoning if self.kind == "reasoning" else content
                if not ends:
                    hold = 0 if last else held_suffix_len(self.buf, (*ENDS, START))
                    out.append(self.buf[:len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold:]
                    break
                at, end = min(ends)
                out.append(self.buf[:at])
                closing = end if end != START else ""
                if self.kind == "raw":
                    content.append(closing)
                self.buf = self.buf[at + len(closing):]
                self.state = "outside"
        return "".join(reasoning), "".join(content)
