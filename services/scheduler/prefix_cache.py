"""Prefix-cache keys: one hash per FULL block, chained from the parent block's hash.

    h(block 0) = sha256(ROOT        || 0x01 || len(salt) as u32 LE || salt (UTF-8) || tokens as u32 LE)
    h(block i) = sha256(h(block i-1) || 0x00 ||                                      tokens as u32 LE)

A block's key thus names its whole prefix, so equal keys mean equal KV (for the same model). The cache salt is
mixed into the first block only: every later key inherits it through the chain. The encoding is fixed (no
Python `hash()`, which is randomized per process), so keys are equal across restarts and machines, and a router
can compute them itself to predict which replica holds a prompt's prefix.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from services.scheduler.request import Request

ROOT_HASH = hashlib.sha256(b"steploop-prefix-cache-v1").digest()


def hash_block(parent: bytes | None, tokens: list[int], salt: str | None = None) -> bytes:
    """Key of one full block; parent is None for a request's first block."""
    if parent is None:
        salt_bytes = (salt or "").encode()
        head = ROOT_HASH + b"\x01" + struct.pack("<I", len(salt_bytes)) + salt_bytes
    else:
        head = parent + b"\x00"
    return hashlib.sha256(head + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def block_tokens(request: Request, index: int, block_size: int) -> list[int]:
    """Token ids of block `index`, without building the request's whole token list."""
    start, end, prompt = index * block_size, (index + 1) * block_size, request.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    out_start = max(start - len(prompt), 0)
    return prompt[start:end] + request.output_token_ids[out_start:end - len(prompt)]


def ensure_block_hashes(request: Request, num_full_blocks: int, block_size: int) -> list[bytes]:
    """Extend request.block_hashes to cover its first num_full_blocks blocks (each hashed once per request)."""
    hashes = request.block_hashes
    while len(hashes) < num_full_blocks:
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, block_tokens(request, len(hashes), block_size), request.cache_salt))
    return hashes


def prompt_block_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Keys of every full block of a token list: what a router computes to predict hits."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size], salt))
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
