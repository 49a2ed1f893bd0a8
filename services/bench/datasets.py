"""Prompts to send: `random` (exact token lengths), `shared-prefix` (N prefixes x M suffixes) and `jsonl`.

Prompts are built from token ids and decoded with the model's tokenizer (found through resolve_model), so a prompt
of n ids is about n tokens when re-encoded; `token_ids` keeps the ids for servers that take them directly
(/v1/completions accepts a list of ids). With no tokenizer, prompts are plain words, about one token each.
"""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "an", "have", "were", "are", "which", "this", "be", "or", "one", "had", "not", "but", "all", "they", "she", "what", "their", "can", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name"]


@dataclass
class SampleRequest:
    prompt: str | list[int]              # text, or token ids when built with a tokenizer and asked for ids
    prompt_len: int                      # tokens
    output_len: int                      # max_tokens to ask for (exact with ignore_eos)
    token_ids: list[int] | None = None   # the ids the text was decoded from, when there was a tokenizer


def load_tokenizer(model: str | None):
    """The model folder's tokenizer (via resolve_model, or `model` as a path), or None when there is none."""
    try:
        from transformers import AutoTokenizer

        from steploop.common.model_path import resolve_model
        try:
            path = resolve_model(model)
        except FileNotFoundError:
            path = pathlib.Path(model or "")
            if not (path / "tokenizer_config.json").is_file():
                return None
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - no tokenizer is a supported mode, not an error
        log.info("no tokenizer (%s); prompts are plain words", exc)
        return None


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """Uniform integers in [mean * (1 - ratio), mean * (1 + ratio)], at least 1 (vLLM's random dataset)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio {ratio} must be in [0, 1)")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


class PromptMaker:
    """Random token ids -> text. Special tokens are excluded so decoding and re-encoding stay close."""

    def __init__(self, tokenizer, rng: np.random.Generator):
        self.tokenizer, self.rng = tokenizer, rng
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            self.vocab = np.array([i for i in range(len(tokenizer)) if i not in special][1000:], dtype=np.int64)

    def ids(self, n: int) -> list[int]:
        if self.tokenizer is None:
            return self.rng.integers(0, len(WORDS), size=n).tolist()
        return self.rng.choice(self.vocab, size=n).tolist()

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(WORDS[i] for i in ids)
        return self.tokenizer.decode(ids)

    def sample(self, ids: list[int], output_len: int, as_ids: bool) -> SampleRequest:
        if as_ids and self.tokenizer is not None:
            return SampleRequest(list(ids), len(ids), int(output_len), list(ids))
        return SampleRequest(self.text(ids), len(ids), int(output_len),
                             list(ids) if self.tokenizer is not None else None)


def random_dataset(num: int, input_len: int, output_len: int, range_ratio: float = 0.0, tokenizer=None,
                   seed: int = 0, as_ids: bool = False) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    ins, outs = _lengths(rng, input_len, range_ratio, num), _lengths(rng, output_len, range_ratio, num)
    return [maker.sample(maker.ids(int(i)), int(o), as_ids) for i, o in zip(ins, outs)]


def shared_prefix_dataset(num_prefixes: int, suffixes_per_prefix: int, prefix_len: int, suffix_len: int,
                          output_len: int, tokenizer=None, seed: int = 0, as_ids: bool = False,
                          shuffle: bool = True) -> list[SampleRequest]:
    """num_prefixes x suffixes_per_prefix prompts: prefix i (prefix_len tokens) + a fresh suffix (suffix_len)."""
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    out = []
    for _ in range(num_prefixes):
        prefix = maker.ids(prefix_len)
        out += [maker.sample(prefix + maker.ids(suffix_len), output_len, as_ids) for _ in range(suffixes_per_prefix)]
    if shuffle:
        out = [out[i] for i in rng.permutation(len(out))]
    return out


def jsonl_dataset(path: str | pathlib.Path, tokenizer=None, default_output_len: int = 128) -> list[SampleRequest]:
    """One JSON object per line: {"prompt": text or [ids], "output_len": n} ("max_tokens" also accepted)."""
    out = []
    for lineno, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": ..., \"output_len\": n}} ({exc})") from None
        output_len = int(row.get("output_len", row.get("max_tokens", default_output_len)))
        if isinstance(prompt, list):
            out.append(SampleRequest(prompt, len(prompt), output_len, list(prompt)))
        elif tokenizer is not None:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            out.append(SampleRequest(prompt, len(ids), output_len, ids))
        else:
            out.append(SampleRequest(prompt, len(prompt.split()), output_len))
    return out
