"""Prefix-cache block keys: one hash per FULL block of `block_size` tokens, chained from the parent block's hash.

The scheduler's prefix cache keys its blocks with these, and the gateway's router computes the same keys from a
prompt to predict which replica holds its prefix (so will KV events, issue 22). Both sides must call this module:
two copies of the encoding drift apart silently (the router's did: it hashed without the root or the salt).

steploop's own function, "sha256" (the default):

    h(block 0) = sha256(ROOT        || 0x01 || len(salt) as u32 LE || salt (UTF-8) || tokens as u32 LE)
    h(block i) = sha256(h(block i-1) || 0x00 ||                                      tokens as u32 LE)

A block's key thus names its whole prefix, so equal keys mean equal KV (for the same model). The cache salt is
mixed into the first block only: every later key inherits it through the chain. The encoding is fixed (no
Python `hash()`, which is randomized per process), so keys are equal across restarts, machines and services.

Functions are registered by name (`BLOCK_HASHERS`), so another encoding can be chosen where keys must match a
peer's, e.g. vLLM's `sha256_cbor` for its KV-event consumers: sha256(cbor2.dumps((parent, tuple(tokens),
extra_keys), canonical=True)), the first parent being sha256_cbor("vllm-none-hash").
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

# (parent key or None for a request's first block, the block's token ids, cache salt or None) -> key
BlockHasher = Callable[[bytes | None, Sequence[int], str | None], bytes]

ROOT_HASH = hashlib.sha256(b"steploop-prefix-cache-v1").digest()
DEFAULT_HASHER = "sha256"


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """steploop's key of one full block ("sha256"); parent is None for a request's first block."""
    if parent is None:
        salt_bytes = (salt or "").encode()
        head = ROOT_HASH + b"\x01" + struct.pack("<I", len(salt_bytes)) + salt_bytes
    else:
        head = parent + b"\x00"
    return hashlib.sha256(head + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def first_block_extra(cache_salt: str | None, lora_name: str | None) -> str | None:
    """The extra key a request's first block mixes in (the `salt` every hasher takes): its cache salt and, for a
    LoRA request, its adapter's name, so prefix-cache hits never cross adapters (nor the base model). A base
    request's key is its salt alone, unchanged. NUL separates the parts; a cache salt may not hold one
    (services/scheduler/engine_loop.py refuses it), so no salt can pose as an adapter."""
    if not lora_name:
        return cache_salt
    return f"\x00lora\x00{lora_name}\x00{cache_salt or ''}"


BLOCK_HASHERS: dict[str, BlockHasher] = {"sha256": hash_block}


def get_block_hasher(name: str = DEFAULT_HASHER) -> BlockHasher:
    try:
        return BLOCK_HASHERS[name]
    except KeyError:
        raise ValueError(f"unknown block hash function {name!r}; known: {', '.join(sorted(BLOCK_HASHERS))}") from None


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                 hasher: BlockHasher = hash_block) -> list[bytes]:
    """Keys of every full block of a token list (a trailing partial block has none)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes
