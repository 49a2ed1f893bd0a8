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

_NEG_INF_STANDIN = -9999.0   # JSON has no -inf; OpenAI clients expect a number


@dataclass(frozen=True)
class TokenInfo:
    """One token with its logprob and the most likely alternatives (as text), ready to render."""
    token: str
    logprob: float | None                    # None: the first prompt token (nothing precedes it)
    top: tuple[tuple[str, float], ...]       # [k] most likely first


def _finite(x: float) -> float:
    return max(_NEG_INF_STANDIN, x)


class TokenNamer:
    """decode([id]) with a cache: logprob requests name the same few thousand ids again and again."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) > 100_000:
                self._cache.clear()
        return text

    def info(self, token_id: int, lp: Any | None) -> TokenInfo:
        """lp: an engine TokenLogprob (pb) or None (first prompt token)."""
        if lp is None:
            return TokenInfo(self(token_id), None, ())
        top = tuple((self(t), _finite(x)) for t, x in zip(lp.top_token_ids, lp.top_logprobs))
        return TokenInfo(self(token_id), _finite(lp.logprob), top)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(tokens: Sequence[TokenInfo]) -> dict[str, Any]:
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
                         "top_logprobs": [{"token": s, "logprob": x, "bytes": _bytes(s)} for s, x in t.top]}
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
