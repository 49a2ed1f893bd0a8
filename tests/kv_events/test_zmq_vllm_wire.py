"""The ZMQ publisher speaks vLLM's wire format: a subscriber written as vLLM's consumers are, decoding with vLLM's
own message classes (copied below from vllm/distributed/kv_events.py, vLLM 0.32.0, field for field), sees one
BlockStored entry per full block with the sha256_cbor hashes this test computes, BlockRemoved on eviction, and
recovers a gap through the replay ROUTER socket."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from tests.integration.cluster import free_port
from tests.kv_events.helpers import expected_chain, low64, make_hub, run_prompt

ExternalBlockHash = bytes | int   # vllm/v1/core/kv_cache_utils.py


# ---- vLLM 0.32.0's definitions (vllm/distributed/kv_events.py) --------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
# -----------------------------------------------------------------------------------------------------------------

END_SEQ = -1


class Subscriber:
    """vLLM's consumer pattern: SUB for live batches; on a sequence gap, ask the replay socket from the missing
    sequence and read (topic, seq, payload) until the end marker."""

    def __init__(self, pub_port: int, replay_port: int) -> None:
        self.ctx, self.pub_port = zmq.Context.instance(), pub_port
        self.sub = self._subscribe()
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.decoder = Decoder(type=KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}
        self.next_seq = 0
        self.replayed = 0

    def _subscribe(self) -> zmq.Socket:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{self.pub_port}")
        return sub

    def disconnect(self) -> None:
        self.sub.close(linger=0)

    def reconnect(self) -> None:
        self.sub = self._subscribe()

    def poll_once(self, timeout_ms: int = 50) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == b"kv"
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.next_seq:
            self.recover(self.next_seq)
        if seq >= self.next_seq:
            self.batches[seq] = self.decoder.decode(payload)
            self.next_seq = seq + 1
        return True

    def recover(self, start: int) -> None:
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(5000), "no replay answer"
            _, topic, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                assert payload == b"" and topic == b""
                return
            assert topic == b"kv"
            self.batches[seq] = self.decoder.decode(payload)
            self.replayed += 1
            self.next_seq = max(self.next_seq, seq + 1)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


@pytest.fixture
def wired():
    pub, replay = free_port(), free_port()
    hub, kv = make_hub(num_blocks=6, block_size=4, publisher="zmq", endpoint=f"tcp://*:{pub}",
                       replay_endpoint=f"tcp://*:{replay}", topic="kv")
    sub = Subscriber(pub, replay)
    yield hub, kv, sub
    sub.close()
    hub.close()


def pump_until_received(hub, kv, sub, start: int, tries: int = 200) -> None:
    """A SUB socket only gets what is published after its subscription reached the PUB side (ZMQ's slow
    joiner): publish distinct small prompts until one arrives. Batches missed meanwhile are gaps for replay."""
    for i in range(tries):
        run_prompt(kv, f"warm-{start + i}", [start + i] * 4)
        hub.flush()
        if sub.poll_once():
            return
    raise AssertionError("the subscriber never received a batch")


def test_vllm_subscriber_sees_stored_and_removed_with_sha256_cbor_hashes(wired):
    hub, kv, sub = wired
    pump_until_received(hub, kv, sub, start=40000)
    prompt = list(range(7, 16))                             # 9 tokens: 2 full blocks of 4
    run_prompt(kv, "p", prompt)
    stored_seq = hub.flush().sequence
    run_prompt(kv, "big", list(range(500, 517)))            # 5 blocks: evicts every cached block
    removed_seq = hub.flush().sequence
    while sub.next_seq <= removed_seq:
        assert sub.poll_once(5000), "batch not received"
    (stored,) = [e for e in sub.batches[stored_seq].events if isinstance(e, BlockStored)]
    assert stored.block_hashes == [low64(h) for h in expected_chain(prompt, 4)]   # one per full block
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == (None, prompt[:8], 4,
                                                                                             "GPU")
    removed = {h for e in sub.batches[removed_seq].events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert {low64(h) for h in expected_chain(prompt, 4)} <= removed
    assert sub.batches[removed_seq].data_parallel_rank == 0


def test_a_gap_is_recovered_through_the_replay_socket(wired):
    hub, kv, sub = wired
    pump_until_received(hub, kv, sub, start=41000)
    sub.disconnect()                                        # the subscriber misses what follows
    missed = []
    for i in range(3):
        run_prompt(kv, f"m{i}", [60000 + i] * 4)
        missed.append(hub.flush().sequence)
    for _ in range(2000):                                   # sent (to no one) before the subscriber is back
        if hub.publisher.last_sent >= missed[-1]:
            break
        time.sleep(0.005)
    sub.reconnect()
    pump_until_received(hub, kv, sub, start=42000)           # the next live batch reveals the gap
    assert sub.replayed >= len(missed)
    for i, seq in enumerate(missed):
        (event,) = [e for e in sub.batches[seq].events if isinstance(e, BlockStored)]
        assert event.block_hashes == [low64(h) for h in expected_chain([60000 + i] * 4, 4)]
    assert sorted(sub.batches) == list(range(min(sub.batches), sub.next_seq))   # nothing missing from there


def test_kv_events_config_is_vllms_json():
    from services.scheduler.kv_events.config import KvEventsConfig, KvEventsConfigError
    config = KvEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                                      '"replay_endpoint": "tcp://*:5558", "buffer_steps": 5, "hwm": 10, '
                                      '"max_queue_size": 7, "topic": "t"}')
    assert config.publisher == "zmq" and config.zmq             # vLLM's default publisher when enabled
    assert KvEventsConfig.from_json('{"enable_kv_cache_events": false}').publisher == "null"
    with pytest.raises(KvEventsConfigError, match="unknown field"):
        KvEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "x"}')
    with pytest.raises(KvEventsConfigError, match="publisher"):
        KvEventsConfig.from_json('{"publisher": "kafka"}')


def test_without_the_extra_a_zmq_config_or_sha256_cbor_is_a_startup_error(monkeypatch):
    import sys

    from services.common.block_hashing import get_block_hasher
    from services.scheduler.kv_events.config import KvEventsConfig, KvEventsConfigError
    monkeypatch.setitem(sys.modules, "zmq", None)          # as if pyzmq were not installed
    with pytest.raises(KvEventsConfigError, match=r"pyzmq.*steploop\[kv-events\]"):
        KvEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert not KvEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').zmq
    monkeypatch.setitem(sys.modules, "cbor2", None)
    with pytest.raises(ValueError, match=r"cbor2.*steploop\[kv-events\]"):
        get_block_hasher("sha256_cbor")
