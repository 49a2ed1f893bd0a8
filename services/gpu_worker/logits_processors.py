"""Per-row logit edits applied before penalties and sampling, batched: logit_bias, min_tokens, allowed_token_ids,
bad_words and grammars.

    logit_bias:  logits[row, token] += bias                      (OpenAI logit_bias, any row that asks)
    min_tokens:  logits[row, eos and stop ids] = -inf            (while the row's output is shorter than min_tokens)
    bad_words:   logits[row, word[-1]] = -inf                    (when the row's output ends with word[:-1]; vLLM's)
    allowed:     logits[row, tokens not in allowed_token_ids] = -inf
    grammar:     logits[row, tokens the grammar forbids] = -inf  (structured output; a packed int32 bitmask)

Bans come after the bias, so a bias never revives a banned token (-inf + b = -inf), as in vLLM. A row whose every
token is banned (allowed ids all bad words) samples token 0 of an all -inf row: the gateway cannot know, so
nothing refuses it; vLLM does the same. Nothing is built when no row uses any of them (the common case). Logprobs
stay those of the raw logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from steploop.common.sampling_params import SamplingParams


@dataclass
class LogitsEdits:
    bias_rows: torch.Tensor | None = None     # [B] int64 rows of the logit_bias entries
    bias_cols: torch.Tensor | None = None     # [B] int64 token ids
    bias_values: torch.Tensor | None = None   # [B] fp32
    ban_rows: torch.Tensor | None = None      # [N] int64 rows of banned (row, token) pairs (min_tokens, bad words)
    ban_cols: torch.Tensor | None = None      # [N] int64
    allowed_rows: torch.Tensor | None = None  # [A] int64 rows of allowed (row, token) pairs (allowed_token_ids)
    allowed_cols: torch.Tensor | None = None  # [A] int64
    restricted_rows: torch.Tensor | None = None   # [R] int64 the distinct rows that have allowed_token_ids
    grammar_bitmask: torch.Tensor | None = None   # [S, ceil(vocab / 32)] int32, bit set = allowed
    grammar_rows: list[int] | None = None         # rows the bitmask applies to (others left alone)

    @classmethod
    def build(cls, params: list[SamplingParams], num_outputs: list[int], eos_token_ids: tuple[int, ...],
              device: torch.device, grammar: tuple[torch.Tensor, list[int]] | None = None,
              outputs: Sequence[Sequence[int]] | None = None) -> LogitsEdits | None:
        """params/num_outputs [S]: each row's sampling params and how many output tokens precede its token.
        outputs [S]: those output tokens (drafts before the row included); read only for rows with bad words."""
        bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
        bans = [(r, t) for r, (p, n) in enumerate(zip(params, num_outputs)) if n < p.min_tokens
                for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids)]
        bans += [(r, t) for r, p in enumerate(params) if p.bad_words
                 for t in bad_word_bans(p.bad_words, outputs[r] if outputs is not None else ())]
        allowed = [(r, p.allowed_token_ids) for r, p in enumerate(params) if p.allowed_token_ids]
        if not bias and not bans and not allowed and grammar is None:
            return None
        edits = cls()
        if bias:
            rows, cols, values = zip(*bias)
            edits.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            edits.bias_cols = torch.tensor(cols, dtype=torch.int64, device=device)
            edits.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        if bans:
            rows, cols = zip(*bans)
            edits.ban_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            edits.ban_cols = torch.tensor(cols, dtype=torch.int64, device=device)
        if allowed:   # a request's ids are the same every step: their tensor is made once (lists may be long)
            cols = [_ids_tensor(ids) for _, ids in allowed]
            edits.allowed_rows = torch.cat([torch.full((len(c),), r, dtype=torch.int64) for (r, _), c
                                            in zip(allowed, cols)]).to(device)
            edits.allowed_cols = torch.cat(cols).to(device)
            edits.restricted_rows = torch.tensor([r for r, _ in allowed], dtype=torch.int64, device=device)
        if grammar is not None:
            edits.grammar_bitmask, edits.grammar_rows = grammar
        return edits


@functools.lru_cache(maxsize=256)
def _ids_tensor(ids: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def bad_word_bans(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens bad_words ban next after `output` (vLLM's rule, on output tokens only): a word's last token,
    when the output ends with the rest of the word (a one-token word: always)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix < 0 or prefix > len(output):
            continue
        if prefix == 0 or list(output[-prefix:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned


def apply_logits_edits(logits: torch.Tensor, edits: LogitsEdits) -> torch.Tensor:
    """logits [S, vocab] fp32 -> edited copy."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if edits.bias_rows is not None:
        ok = edits.bias_cols < vocab
        logits.index_put_((edits.bias_rows[ok], edits.bias_cols[ok]), edits.bias_values[ok], accumulate=True)
    if edits.ban_rows is not None:
        ok = edits.ban_cols < vocab
        logits[edits.ban_rows[ok], edits.ban_cols[ok]] = float("-inf")
    if edits.allowed_rows is not None:
        ok = edits.allowed_cols < vocab    # keep the allowed values, -inf the rest of those rows (no [S, vocab] mask)
        rows, cols = edits.allowed_rows[ok], edits.allowed_cols[ok]
        kept = logits[rows, cols]
        logits.index_fill_(0, edits.restricted_rows, float("-inf"))
        logits[rows, cols] = kept
    if edits.grammar_bitmask is not None:
        apply_bitmask(logits, edits.grammar_bitmask, edits.grammar_rows)
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in rows (plain torch, any device)."""
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    words = bitmask.to(logits.device)[index]                              # [R, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]   # [R, W * 32] -> [R, vocab]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
