"""vLLM's token-level output controls: `allowed_token_ids` (only these may be sampled) and `bad_words` (strings
never generated), parsed here; the worker applies them (gpu_worker/logits_processors.py).

A bad word is tokenized as vLLM's SamplingParams.update_from_tokenizer does: once as written (leading spaces
stripped), and once with one leading space when that gives another first token and as many tokens (so "Paris"
is banned both at the start of the text and after a space). A word of n tokens bans its last token only where
the output's last n - 1 tokens are the rest of it. An empty list means "not used", as vLLM's clients send it.
"""

from __future__ import annotations

from typing import Any, Protocol

from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v

MAX_BAD_WORDS = 1024          # words per request (each becomes one or two token sequences)
MAX_BAD_WORD_CHARS = 1024


class Encoder(Protocol):
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def parse_allowed_token_ids(body: dict[str, Any], vocab_size: int | None) -> tuple[int, ...]:
    """Sorted, deduplicated ids; () when absent, null or empty. An id outside the vocabulary is a 400."""
    value = body.get("allowed_token_ids")
    if value is None or value == []:
        return ()
    return tuple(sorted(set(v.get_token_ids(value, "allowed_token_ids", vocab_size))))


def parse_bad_words(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("bad_words")
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise v.type_error("bad_words", "an array of strings", value)
    if len(value) > MAX_BAD_WORDS:
        raise bad_request(f"'bad_words' has {len(value)} words; at most {MAX_BAD_WORDS}", param="bad_words")
    for word in value:
        if not word.strip():
            raise bad_request("'bad_words' must not hold empty or blank strings", param="bad_words")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise bad_request(f"'bad_words' strings must be at most {MAX_BAD_WORD_CHARS} characters",
                              param="bad_words")
    return tuple(value)


async def bad_words_token_ids(tokenizer: Encoder, words: tuple[str, ...],
                        vocab_size: int | None) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences (vLLM's rule, module docstring), deduplicated. A token id the model does not
    have (a tokenizer larger than the model's vocabulary) is a 400 naming bad_words."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(await tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(await tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if vocab_size:
        bad = [t for ids in out for t in ids if t >= vocab_size]
        if bad:
            raise bad_request(f"'bad_words' tokenize to token id {bad[0]}, outside the model's vocabulary "
                              f"({vocab_size})", param="bad_words")
    return tuple(dict.fromkeys(out))
