"""A token's own UTF-8 bytes, for chat logprobs' `bytes` field, when decoding the token alone cannot give them.

A token that holds part of a multi-byte character (an emoji is often 2-4 byte-level tokens) decodes alone to
U+FFFD; OpenAI's `bytes` exists so a client can join such tokens' bytes back into the character, so it must carry
the token's real bytes, not the replacement character's. They come from the token's vocabulary piece: byte-level
BPE (GPT-2, Llama 3, Qwen, SmolLM) spells each byte as one printable character, and SentencePiece's byte fallback
spells a byte as `<0xHH>`.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable bytes stand for themselves, the others are shifted to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


def piece_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The bytes the token's vocabulary piece stands for, or None when the piece is neither byte-level BPE nor a
    byte-fallback token. Only meaningful for tokens whose decoded text has U+FFFD (see TokenNamer)."""
    hf = getattr(tokenizer, "hf", tokenizer)   # gateway's Tokenizer wraps the HuggingFace one
    convert = getattr(hf, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    piece = convert(int(token_id))
    if not isinstance(piece, str) or not piece:
        return None
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    decoder = _byte_level_decoder()
    if all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece)
    return None
