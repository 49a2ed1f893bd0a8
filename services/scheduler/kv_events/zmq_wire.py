"""vLLM's KV-event wire format, for the ZMQ publisher: msgspec Structs with vLLM's options and field order
(vllm/distributed/kv_events.py, vLLM 0.32.0). EventBatch is array_like ([ts, events, data_parallel_rank]); the
events are tagged Structs (tag=True: a "type" key naming the class), which 0.32.0 encodes as maps. Fields
without a default are always sent, so a vLLM decoder finds every one it requires. Block hashes go out as vLLM's
ExternalBlockHash: by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 there, STEPLOOP_KV_EVENTS_INT_BLOCK_HASHES
here) the low 64 bits of the key as an int (maybe_convert_block_hash), else the key's bytes.

Imported only when the ZMQ publisher runs (msgspec is the optional extra steploop[kv-events]).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from steploop.common import envs
from steploop.scheduler.kv_events import events as ev

INT_BLOCK_HASHES = os.environ.get(envs.KV_EVENTS_INT_BLOCK_HASHES, "1").lower() not in ("0", "false", "no", "off")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of vLLM's KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def external_hash(key: bytes) -> int | bytes:
    """vLLM's maybe_convert_block_hash."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1) if INT_BLOCK_HASHES else key


def to_wire(event: ev.KvEvent) -> KVCacheEvent:
    if isinstance(event, ev.BlockStored):
        parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
        return BlockStored([external_hash(h) for h in event.block_hashes], parent, event.token_ids,
                           event.block_size, None, event.medium, None, event.extra_keys)
    if isinstance(event, ev.BlockRemoved):
        return BlockRemoved([external_hash(h) for h in event.block_hashes], event.medium)
    return AllBlocksCleared()


def encode_batch(encoder: msgspec.msgpack.Encoder, batch: ev.KvEventBatch, data_parallel_rank: int = 0) -> bytes:
    return encoder.encode(EventBatch(batch.ts, [to_wire(e) for e in batch.events], data_parallel_rank))


class KVEventBatch(EventBatch):
    """A batch whose events decode to the classes above (vLLM's KVEventBatch)."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A ZMQ payload (ours or vLLM's) as vLLM's consumers decode it."""
    return _DECODER.decode(payload)
