"""Which CUDA graphs a worker captures, and which one each step replays (host logic only: tested on the CPU).

Whole-step graphs, as the unified attention kernel allows: one launch serves any mix of prompt chunks and decodes,
so a step's shape is just (tokens, requests, query tiles). Two families, each with and without LoRA:

    family   captured sizes (padded tokens T)         requests R      attention tiles          splits
    decode   1 2 4 8 16 32 64 128 256                 R = T           T (16-row tiles)          by max_model_len
    mixed    16 32 64 128 256 512 1024 2048 (<= cap)  min(T, max_reqs) T // block_q + R        1

A step picks the smallest graph of its family that holds its tokens, requests and tiles; the rest is padding:

    tokens   T_real .. T-1       slot -1 (no KV write), attend nothing (no tile covers them), never read back
    requests R_real .. R         zero-length queries, seq_len 0 (request R is the spare every padding tile names)
    tiles    tiles_real .. cap   point at the spare request: no query row, no key, no write
    logits   rows S_real .. S    row 0 (gathered, discarded)
    LoRA     segments past the step's, length 0; token rows past T', index 0 (the kernels touch neither)

A step runs eagerly (and says why) when: it has prompt-logprob rows (their lm_head slices run outside any graph),
more tokens / requests than the largest graph, a mixed step that needs split-KV (none is captured), or a LoRA step
whose adapters' rank exceeds the captured stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIXED_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True, order=True)
class GraphKey:
    kind: str        # "decode" or "mixed"
    tokens: int      # padded number of tokens T
    lora: bool       # captured with the LoRA hooks armed over static segments


@dataclass(frozen=True)
class GraphShape:
    """The static sizes one graph is captured at."""
    key: GraphKey
    max_reqs: int        # R: request rows (plus one spare padding request)
    max_tiles: int       # query tiles of the attention grid
    block_q: int         # query tokens per tile (a constexpr of the captured kernel)
    max_logits: int      # logits rows


@dataclass(frozen=True)
class Choice:
    shape: GraphShape | None     # None: run eagerly
    why_eager: str = ""


class CapturePlan:
    def __init__(self, qpk_p: int, max_reqs: int, max_tokens: int, lora: bool,
                 decode_sizes: tuple[int, ...] = DECODE_SIZES, mixed_sizes: tuple[int, ...] = MIXED_SIZES):
        """qpk_p: query heads per KV head rounded to a power of 2 (sets the tiles' rows); max_reqs: the most
        requests a step may hold (--max-num-seqs, as the scheduler said); max_tokens: the largest mixed graph."""
        self.qpk_p, self.lora = qpk_p, lora
        self.decode_block_q = max(16 // qpk_p, 1)          # paged_attention.choose_block_q for decode-only steps
        self.mixed_block_q = max(64 // qpk_p, 1)           # ... and for steps with prompt chunks
        decode = [s for s in decode_sizes if s <= max_reqs] or [min(decode_sizes)]
        mixed = [s for s in mixed_sizes if s <= max_tokens]
        self.shapes: dict[GraphKey, GraphShape] = {}
        for with_lora in (False, True) if lora else (False,):
            for t in decode:
                key = GraphKey("decode", t, with_lora)
                self.shapes[key] = GraphShape(key, t, t, self.decode_block_q, t)     # one tile per request
            for t in mixed:
                key = GraphKey("mixed", t, with_lora)
                r = min(t, max_reqs)
                self.shapes[key] = GraphShape(key, r, t // self.mixed_block_q + r, self.mixed_block_q, t)

    def capture_order(self) -> list[GraphKey]:
        """Capture order: largest first in each family (smaller graphs reuse the pool the largest sized)."""
        return sorted(self.shapes, key=lambda k: (k.lora, k.kind, -k.tokens))

    def choose(self, query_lens: np.ndarray, num_logits: int, with_lora: bool = False,
               prompt_logprobs: bool = False, needs_split: bool = False) -> Choice:
        """query_lens [R] of the step; num_logits: rows the step samples from; needs_split: the step's attention
        wants split-KV (long contexts in a mixed step)."""
        if prompt_logprobs:
            return Choice(None, "prompt-logprob rows run outside graphs")
        if with_lora and not self.lora:
            return Choice(None, "no LoRA graphs captured")
        num_reqs, num_tokens = len(query_lens), int(query_lens.sum())
        if num_reqs == 0:
            return Choice(None, "empty step")
        decode = int(query_lens.max()) == 1 and num_logits == num_reqs
        if not decode and needs_split:
            return Choice(None, "a mixed step whose attention wants split-KV (none captured)")
        kind = "decode" if decode else "mixed"
        block_q = self.decode_block_q if decode else self.mixed_block_q
        tiles = int((-(-query_lens.astype(np.int64) // block_q)).sum())
        for shape in self._family(kind, with_lora):
            if num_tokens <= shape.key.tokens and num_reqs <= shape.max_reqs and tiles <= shape.max_tiles \
                    and num_logits <= shape.max_logits:
                return Choice(shape)
        if decode:      # a decode batch past the decode graphs may still fit a mixed one (no split-KV there)
            tiles = int((-(-query_lens.astype(np.int64) // self.mixed_block_q)).sum())
            for shape in self._family("mixed", with_lora):
                if num_tokens <= shape.key.tokens and num_reqs <= shape.max_reqs and tiles <= shape.max_tiles:
                    return Choice(shape)
        return Choice(None, f"{num_tokens} tokens / {num_reqs} requests exceed the largest graph")

    def _family(self, kind: str, with_lora: bool) -> list[GraphShape]:
        return sorted((s for k, s in self.shapes.items() if k.kind == kind and k.lora == with_lora),
                      key=lambda s: s.key.tokens)


def graph_plan(config, cfg, lora: bool) -> CapturePlan:
    """The worker's plan: its model's GQA group, the scheduler's --max-num-seqs and token budget (mixed graphs up to
    min(budget, 2048) tokens: larger steps are prefill-heavy, where launches are a small share of the time)."""
    qpk = cfg.num_attention_heads // cfg.num_key_value_heads
    return CapturePlan(1 << max(qpk - 1, 0).bit_length(), config.max_num_seqs,
                       min(config.max_num_batched_tokens, MIXED_SIZES[-1]), lora)
