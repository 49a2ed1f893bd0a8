"""Token logprobs in OpenAI's two shapes, from the engine's TokenLogprob (ids and floats) plus the tokenizer.

    chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}
    vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...] (one per prompt token)

A token's text is `decode([id])` (special tokens kept), as vLLM reports it. The first prompt token of an echo
has no logprob (null) and no top logprobs (null). Completions' top_logprobs dicts hold the top k and the token
itself (as vLLM), so a caller can tell whether the token was the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from steploop.gateway.text.detokenizer import Decoder
from steploop.gateway.text.token_bytes import piece_bytes

_NEG_INF_STANDIN = -9999.0   # JSON has no -inf; OpenAI clients expect a number


@dataclass(frozen=True)
class TokenInfo:
    """One token with its logprob and the most likely alternatives (as text), ready to render."""
    token: str
    logprob: float | None                    # None: the first prompt token (nothing precedes it)
    top: tuple[tuple[str, float], ...]       # [k] most likely first
    # The token's bytes where its text is not them (part of a multi-byte character decodes to U+FFFD), then
    # the same for each of `top`; None: the text's own UTF-8 bytes are right.
    token_bytes: bytes | None = None
    top_bytes: tuple[bytes | None, ...] = ()


def _finite(x: float) -> float:
    return max(_NEG_INF_STANDIN, x)


class TokenNamer:
    """decode([id]) with a cache: logprob requests name the same few thousand ids again and again."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, bytes | None] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) > 100_000:
                self._cache.clear()
        return text

    def raw_bytes(self, token_id: int) -> bytes | None:
        """The token's own bytes when its decoded text lost them to U+FFFD; None otherwise."""
        if token_id not in self._bytes:
            if len(self._bytes) > 100_000:
                self._bytes.clear()
            self._bytes[token_id] = piece_bytes(self._tokenizer, token_id) if "\ufffd" in self(token_id) else None
        return self._bytes[token_id]

    def info(self, token_id: int, lp: Any | None) -> TokenInfo:
        """lp: an engine TokenLogprob (pb) or None (first prompt token)."""
        if lp is None:
            return TokenInfo(self(token_id), None, (), self.raw_bytes(token_id))
        top = tuple((self(t), _finite(x)) for t, x in zip(lp.top_token_ids, lp.top_logprobs))
        return TokenInfo(self(token_id), _finite(lp.logprob), top, self.raw_bytes(token_id),
                         tuple(self.raw_bytes(t) for t in lp.top_token_ids))


def _bytes(text: str, raw: bytes | None) -> list[int]:
    return list(raw if raw is not None else text.encode("utf-8"))


def chat_logprobs(tokens: Sequence[TokenInfo]) -> dict[str, Any]:
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token, t.token_bytes),
                         "top_logprobs": [{"token": s, "logprob": x, "bytes": _bytes(s, raw)}
                                          for (s, x), raw in zip(t.top, t.top_bytes or (None,) * len(t.top))]}
                        for t in tokens]}


def completion_logprobs(tokens: Sequence[TokenInfo], text_offset: int = 0) -> dict[str, Any]:
    """`text_offset`: where the first token starts in the choice's text (echo puts the prompt first)."""
    offsets, top = [], []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
        if t.logprob is None:
            top.append(None)
        else:
            entry = dict(t.top)
            entry.setdefault(t.token, t.logprob)
            top.append(entry)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(namer: TokenNamer, prompt_ids: Sequence[int], lps: Sequence[Any],
                         k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: null for the first prompt token, then per token a dict keyed by token id holding
    the token itself (its logprob and rank: 1 + tokens more likely) and the top k (ranks 1..k), as vLLM builds it
    (a token in its own top k appears once). lps: the engine's TokenLogprob of prompt tokens 1 ..; top k >= k."""
    out: list[dict[str, Any] | None] = [None]
    for token, lp in zip(prompt_ids[1:], lps):
        entry = {str(token): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": namer(token)}}
        for rank, (t, x) in enumerate(zip(lp.top_token_ids[:k], lp.top_logprobs[:k]), start=1):
            entry[str(t)] = {"logprob": _finite(x), "rank": rank, "decoded_token": namer(t)}
        out.append(entry)
    return out
