"""Prefix-cache block keys: one hash per FULL block of `block_size` tokens, chained from the parent block's hash.

The scheduler's prefix cache keys its blocks with these, and the gateway's router computes the same keys from a
prompt to predict which replica holds its prefix (so will KV events, issue 22). Both sides must call this module:
two copies of the encoding drift apart silently (the router's did: it hashed without the root or the salt).

steploop's own function, "sha256" (the default):

    h(block 0) = sha256(ROOT        || 0x01 || len(salt) as u32 LE || salt (UTF-8) || tokens as u32 LE)
    h(block i) = sha256(h(block i-1) || 0x00 ||                                      tokens as u32 LE)

A block whose tokens meet an image's placeholder range appends `0x02 || (len(hash) as u32 LE || hash (UTF-8))` for
each such image (vLLM's multimodal extra keys): placeholder ids are the same for every image, so the image's
content hash is what tells two images apart; a repeated image gives the same keys (a prefix-cache hit).
A block's key thus names its whole prefix, so equal keys mean equal KV (for the same model). The cache salt is
mixed into the first block only: every later key inherits it through the chain. The encoding is fixed (no
Python `hash()`, which is randomized per process), so keys are equal across restarts, machines and services.

Functions are registered by name (`BLOCK_HASHERS`; the scheduler's `--prefix-caching-hash-algo`), so another
encoding can be chosen where keys must match a peer's. "sha256_cbor" is vLLM's (vllm/utils/hashing.py sha256_cbor
and vllm/v1/core/kv_cache_utils.py hash_block_tokens / init_none_hash, vLLM 0.32.0), for routers written for vLLM's
KV events:

    h(block i) = sha256(cbor2.dumps((h(block i-1) or NONE_HASH, tuple(tokens), extra_keys), canonical=True))
    NONE_HASH  = sha256(cbor2.dumps(PYTHONHASHSEED if set, else "vllm-none-hash", canonical=True))
    extra_keys = (*image hashes of the block, ("cache_salt", salt) for a salted request's first block), None if empty

vLLM before 0.32 drew NONE_HASH at random per process when PYTHONHASHSEED was unset (then no two processes
agree); 0.32 fixed the default seed for its cryptographic hashes, and so does this. vLLM's own "sha256" pickles
the tuple (Python-only, not reproducible outside CPython); steploop's "sha256" above is its own fixed encoding.
cbor2 is the optional extra `steploop[kv-events]`; choosing sha256_cbor without it fails at start-up.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Callable, Sequence

# (parent key or None for a request's first block, the block's token ids, cache salt or None) -> key; keyword
# mm_hashes: the hashes of the images whose placeholder range the block meets, in prompt order.
BlockHasher = Callable[..., bytes]

ROOT_HASH = hashlib.sha256(b"steploop-prefix-cache-v1").digest()
DEFAULT_HASHER = "sha256"


VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"   # vllm/v1/core/kv_cache_utils.py DEFAULT_NONE_HASH_SEED


@functools.cache
def _packer(num_tokens: int) -> Callable[..., bytes]:
    return struct.Struct(f"<{num_tokens}I").pack     # one compiled format per block size, not one per block


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None = None, *,
               root: bytes = ROOT_HASH, mm_hashes: Sequence[str] = ()) -> bytes:
    """steploop's key of one full block ("sha256"); parent is None for a request's first block. Runs once per
    block a decode fills (1 in block_size request-steps), so the packing format is cached."""
    if parent is None:
        salt_bytes = (salt or "").encode()
        head = root + b"\x01" + struct.pack("<I", len(salt_bytes)) + salt_bytes
    else:
        head = parent + b"\x00"
    tail = b"".join(b"\x02" + struct.pack("<I", len(h)) + h.encode() for h in mm_hashes)
    return hashlib.sha256(head + _packer(len(tokens))(*tokens) + tail).digest()


def first_block_extra(cache_salt: str | None, lora_name: str | None) -> str | None:
    """The extra key a request's first block mixes in (the `salt` every hasher takes): its cache salt and, for a
    LoRA request, its adapter's name, so prefix-cache hits never cross adapters (nor the base model). A base
    request's key is its salt alone, unchanged. NUL separates the parts; a cache salt may not hold one
    (services/scheduler/engine_loop.py refuses it), so no salt can pose as an adapter."""
    if not lora_name:
        return cache_salt
    return f"\x00lora\x00{lora_name}\x00{cache_salt or ''}"


def _cbor2():
    try:
        import cbor2
    except ImportError:
        raise ValueError("block hash function 'sha256_cbor' needs cbor2: pip install 'steploop[kv-events]'") from None
    return cbor2


def sha256_cbor(value: object) -> bytes:
    """vLLM's sha256_cbor: SHA-256 of the canonical CBOR encoding (reproducible in any language)."""
    return hashlib.sha256(_cbor2().dumps(value, canonical=True)).digest()


@functools.cache
def vllm_none_hash() -> bytes:
    """vLLM's NONE_HASH for sha256_cbor (the first block's parent), from this process's PYTHONHASHSEED."""
    return sha256_cbor(os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_NONE_HASH_SEED))


def hash_block_cbor(parent: bytes | None, tokens: Sequence[int], salt: str | None = None, *,
                    root: bytes | None = None, mm_hashes: Sequence[str] = ()) -> bytes:
    """vLLM's key of one full block ("sha256_cbor"); `root` overrides NONE_HASH (a peer's, as it reported it)."""
    extra = (*mm_hashes, *((("cache_salt", salt),) if parent is None and salt else ()))
    extra_keys = extra or None
    if parent is None:
        parent = root if root is not None else vllm_none_hash()
    return sha256_cbor((parent, tuple(tokens), extra_keys))


BLOCK_HASHERS: dict[str, BlockHasher] = {"sha256": hash_block, "sha256_cbor": hash_block_cbor}


def get_block_hasher(name: str = DEFAULT_HASHER, root: bytes | None = None) -> BlockHasher:
    """The registered function `name`; with `root`, its first block chains from that key (a peer's root)."""
    try:
        hasher = BLOCK_HASHERS[name]
    except KeyError:
        raise ValueError(f"unknown block hash function {name!r}; known: {', '.join(sorted(BLOCK_HASHERS))}") from None
    if name == "sha256_cbor":
        _cbor2()   # fail at start-up, not on the first request
    return hasher if root is None else functools.partial(hasher, root=root)


def hasher_root(name: str) -> bytes:
    """The key the first block of `name` chains from in this process (reported to routers with KV events)."""
    return vllm_none_hash() if name == "sha256_cbor" else ROOT_HASH


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                 hasher: BlockHasher = hash_block, images: Sequence[tuple[str, int, int]] = ()) -> list[bytes]:
    """Keys of every full block of a token list (a trailing partial block has none); images: (hash, offset,
    length) of each image's placeholder range."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        mm = block_images(images, start, start + block_size)
        parent = hasher(parent, token_ids[start:start + block_size], salt, **({"mm_hashes": mm} if mm else {}))
        hashes.append(parent)
    return hashes


def block_images(images: Sequence[tuple[str, int, int]], start: int, end: int) -> tuple[str, ...]:
    """Hashes of the images whose placeholder range [offset, offset + length) meets tokens [start, end)."""
    return tuple(h for h, offset, length in images if offset < end and start < offset + length)
