"""The KV-event contract inside the scheduler: plain dataclasses mirroring vLLM's event classes
(vllm/distributed/kv_events.py, vLLM 0.32.0: BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch), with
the protobuf conversion at the edge (to_pb). Keys are full 32-byte block hashes here and on gRPC; the ZMQ
publisher converts them as vLLM does (zmq_wire.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from steploop.common.pb.steploop.v1 import engine_pb2

MEDIUM_GPU = "GPU"   # vLLM's MEDIUM_GPU: the worker's KV cache (the pool); "CPU" and "DISK": tiers below it


@dataclass
class BlockStored:
    block_hashes: list[bytes]            # consecutive full blocks of one request, in token order
    parent_block_hash: bytes | None      # the key before block_hashes[0]; None for a request's first block
    token_ids: list[int]                 # [len(block_hashes) * block_size] the blocks' tokens
    block_size: int
    extra_keys: list[tuple | None] | None = None   # per block, vLLM's untagged form: image hashes, then cache_salt on block 0
    medium: str = MEDIUM_GPU

    def to_pb(self) -> engine_pb2.KvEvent:
        stored = engine_pb2.KvEventBlockStored(block_hashes=self.block_hashes, token_ids=self.token_ids,
                                               block_size=self.block_size, medium=self.medium)
        if self.parent_block_hash is not None:
            stored.parent_block_hash = self.parent_block_hash
        return engine_pb2.KvEvent(stored=stored)


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]            # keys evicted (their blocks were reused), in eviction order
    medium: str = MEDIUM_GPU

    def to_pb(self) -> engine_pb2.KvEvent:
        return engine_pb2.KvEvent(removed=engine_pb2.KvEventBlockRemoved(block_hashes=self.block_hashes,
                                                                         medium=self.medium))


@dataclass
class AllBlocksCleared:
    def to_pb(self) -> engine_pb2.KvEvent:
        return engine_pb2.KvEvent(cleared=engine_pb2.KvEventAllBlocksCleared())


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KvEventBatch:
    sequence: int                        # 0, 1, 2, ... per scheduler process (ZMQ's seq frame, gRPC's sequence)
    ts: float                            # time.time() when the step's events were taken
    events: list[KvEvent] = field(default_factory=list)

    def to_pb(self) -> engine_pb2.KvEventBatch:
        return engine_pb2.KvEventBatch(sequence=self.sequence, ts=self.ts, events=[e.to_pb() for e in self.events])
