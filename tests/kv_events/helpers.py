"""Shared by the KV-event tests: hashes computed here from vLLM's definition, and a KV manager wired to a hub."""

from __future__ import annotations

import hashlib
import os

import cbor2

from steploop.common.block_hashing import get_block_hasher, hasher_root
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.kv_events.config import KvEventsConfig
from steploop.scheduler.kv_events.hub import KvEventHub
from steploop.scheduler.request import Request

SEED = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")


def cbor_sha256(value) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def expected_chain(tokens, block_size, seed=SEED, salt=None) -> list[bytes]:
    """vLLM's sha256_cbor keys of every full block of `tokens` (hash_block_tokens chained from NONE_HASH)."""
    parent, out = cbor_sha256(seed), []
    for i in range(len(tokens) // block_size):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = cbor_sha256((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra))
        out.append(parent)
    return out


def low64(key: bytes) -> int:
    """vLLM's ExternalBlockHash as it publishes it by default (maybe_convert_block_hash)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def make_hub(num_blocks: int, block_size: int, **config) -> tuple[KvEventHub, KVCacheManager]:
    hub = KvEventHub(KvEventsConfig(enable_kv_cache_events=True, **{"publisher": "null", **config}),
                     "sha256_cbor", hasher_root("sha256_cbor"))
    kv = KVCacheManager(num_blocks, block_size, hasher=get_block_hasher("sha256_cbor"), events=hub.recorder)
    hub.watch_cache(lambda: (list(kv.pool.block_hash.values()), kv.block_size))
    return hub, kv


def run_prompt(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> Request:
    """Admit, compute every prompt token (keying its full blocks), then finish: the blocks stay cached, free."""
    request = Request(request_id=rid, prompt_token_ids=tokens, sampling=SamplingParams(max_tokens=1),
                      cache_salt=salt)
    hits, num_hit = kv.get_computed_blocks(request)
    request.num_computed_tokens = num_hit
    assert kv.allocate_slots(request, len(tokens) - num_hit, hits) is not None
    kv.cache_blocks(request, len(tokens))
    kv.free(request)
    return request
