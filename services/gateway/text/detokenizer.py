"""Incremental detokenization, as in vLLM / TGI: turn a growing list of token ids into text deltas.

Decoding one token at a time is wrong for byte-level BPE (a Chinese character or an emoji spans several tokens,
each a fragment of UTF-8) and for SentencePiece (a token's leading space depends on its left neighbour). So we
decode a small window twice and emit the difference:

    ids:  ... p r o m p t | t1 t2 t3 ... tN
                ^prefix_offset      ^read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(ids[prefix_offset:])              # with the new tokens
    delta       = new_text[len(prefix_text):]

If new_text ends in U+FFFD the last token(s) are an incomplete UTF-8 sequence: emit nothing and keep the window,
so the character comes out whole once its last byte arrives. Otherwise slide the window forward. When the
generation ends on such a sequence, `flush` emits it as decode() renders it (U+FFFD), so the streamed text always
adds up to decode(output ids).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

# How many prompt tokens seed the window, so the first output token decodes with its left context.
INITIAL_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-INITIAL_OFFSET:])   # only the window's left context is needed
        self._read_offset = len(self._ids)   # ids[:read_offset] are emitted; the window starts at 0
        self.output_text = ""            # everything emitted so far

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends new token ids; returns the text they complete (possibly "")."""
        delta = "".join(self._step(token_id) for token_id in token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """The text still held back at the end of the generation (half a character: decoded as U+FFFD)."""
        delta = self._emit(final=True) if len(self._ids) > self._read_offset else ""
        self.output_text += delta
        return delta

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[:self._read_offset], skip_special_tokens=self._skip_special)
        new_text = decode(self._ids, skip_special_tokens=self._skip_special)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""    # a special token that was skipped, or half a character: wait for more
        # Slide: the old read offset becomes the prefix offset. Ids left of it are dropped, which keeps each
        # step O(window) rather than O(output).
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
