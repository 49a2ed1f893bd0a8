"""N-gram prompt lookup: draft tokens copied from the request's own history (no draft model).

If the last n tokens occurred before, the tokens that followed that occurrence are a cheap guess at what comes
next (code edits, quotes of the prompt, repetitive text). The worker verifies the drafts in one forward pass and
keeps the matching prefix plus one token of its own, so outputs are exactly those of plain decoding.
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix.

        n runs from max_n down to min_n; for each n the occurrence closest to the end wins (recent context is
        the best predictor). [] when nothing matches or no draft is allowed.
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        if k <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = _last_occurrence(tokens, size - n, n)
            if start >= 0:
                return tokens[start + n:start + n + k]
        return []


def _last_occurrence(tokens: list[int], suffix_start: int, n: int) -> int:
    """Start of the latest occurrence of tokens[suffix_start:] that begins before suffix_start, or -1."""
    last = tokens[-1]
    suffix = tokens[suffix_start:]
    # Scan candidate end positions right to left; comparing the last token first rejects most of them cheaply.
    end = suffix_start + n - 2                   # the occurrence must end before the suffix's own last token
    while end >= n - 1:
        try:
            end = _rindex(tokens, last, n - 1, end)
        except ValueError:
            return -1
        if tokens[end - n + 1:end + 1] == suffix:
            return end - n + 1
        end -= 1
    return -1


def _rindex(tokens: list[int], value: int, lo: int, hi: int) -> int:
    """Largest i in [lo, hi] with tokens[i] == value; ValueError if none."""
    for i in range(hi, lo - 1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)


def propose_drafts(proposer: NgramProposer, request, placeholders: int, max_model_len: int) -> list[int]:
    """Drafts for one decoding request, never past max_tokens or max_model_len (the worker adds 1 token itself).

    With `placeholders` tokens in flight (async scheduling) the proposal's first tokens are guesses at those and
    the drafts are what follows them: a wrong guess only costs rejected drafts, the worker verifies every one.
    """
    room = min(request.sampling.max_tokens - request.num_output_tokens,
               max_model_len - request.num_tokens) - placeholders - 1
    if room <= 0:
        return []
    return proposer.propose(request.all_token_ids, room + placeholders)[placeholders:]
