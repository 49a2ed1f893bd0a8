"""The scheduler's side of prefix-cache keys: a request's block hashes, extended as its blocks fill, and the hit
counters. The keys themselves (one per FULL block, chained, the cache salt in the first) are
services/common/block_hashing.py's, which the gateway's router computes too.
"""

from __future__ import annotations

from dataclasses import dataclass

from steploop.common.block_hashing import BlockHasher, block_images, first_block_extra, hash_block
from steploop.scheduler.request import Request


def block_tokens(request: Request, index: int, block_size: int) -> list[int]:
    """Token ids of block `index`, without building the request's whole token list."""
    start, end, prompt = index * block_size, (index + 1) * block_size, request.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    out_start = max(start - len(prompt), 0)
    return prompt[start:end] + request.output_token_ids[out_start:end - len(prompt)]


def ensure_block_hashes(request: Request, num_full_blocks: int, block_size: int,
                        hasher: BlockHasher = hash_block) -> list[bytes]:
    """Extend request.block_hashes to cover its first num_full_blocks blocks (each hashed once per request)."""
    hashes = request.block_hashes
    while len(hashes) < num_full_blocks:
        parent = hashes[-1] if hashes else None
        extra = first_block_extra(request.cache_salt, request.lora_name) if parent is None else None
        index = len(hashes)
        mm = block_images([(f.hash, f.offset, f.length) for f in request.mm_features], index * block_size,
                          (index + 1) * block_size) if request.mm_features else ()
        hashes.append(hasher(parent, block_tokens(request, index, block_size), extra,
                             **({"mm_hashes": mm} if mm else {})))
    return hashes


@dataclass
class PrefixCacheStats:
    """Counters since start, for `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (in tokens)."""

    requests: int = 0        # admissions that looked the cache up
    queries: int = 0         # tokens looked up (each admitted request's num_tokens)
    hits: int = 0            # of those, tokens found cached
    resets: int = 0          # reset_prefix_cache() calls (worker lost)

    def record(self, num_tokens: int, num_hit: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
