"""steploop against bytes vLLM itself produced (tests/kv_events/golden/vllm_kv_events.json, captured from vLLM 0.32.0's
own ZmqEventPublisher and request block hasher by scripts/capture_vllm_kv_golden.py; re-capture there): the same
sha256_cbor keys for the same tokens, a decoder that reads every field vLLM sends, and an encoder and publisher
that put the same bytes on the wire for the same events."""

from __future__ import annotations

import json
import os
import pathlib

import msgspec
import pytest
import zmq

from steploop.common.block_hashing import block_hashes, get_block_hasher, hasher_root, sha256_cbor
from steploop.scheduler.kv_events import events as ev
from steploop.scheduler.kv_events import zmq_wire
from steploop.scheduler.kv_events.config import KvEventsConfig
from steploop.scheduler.kv_events.zmq_publisher import ZmqEventPublisher

GOLDEN = json.loads((pathlib.Path(__file__).with_name("golden") / "vllm_kv_events.json").read_text())
KEYS = GOLDEN["block_keys"]
BATCHES = {b["name"]: {k: bytes.fromhex(v) if k != "name" else v for k, v in b.items()} for b in GOLDEN["batches"]}
TS = GOLDEN["timestamp_base"]


def keys(name: str) -> list[bytes]:
    return [bytes.fromhex(k) for k in KEYS["sequences"][name]["keys"]]


def tokens(name: str) -> list[int]:
    return KEYS["sequences"][name]["token_ids"]


def test_none_hash_is_vllms():
    assert sha256_cbor(KEYS["none_hash_seed"]) == bytes.fromhex(KEYS["none_hash"])
    if "PYTHONHASHSEED" not in os.environ:            # this process's own root is vLLM's default one
        assert hasher_root("sha256_cbor") == bytes.fromhex(KEYS["none_hash"])


@pytest.mark.parametrize("name", sorted(KEYS["sequences"]))
def test_sha256_cbor_keys_are_vllms(name):
    sequence = KEYS["sequences"][name]
    hasher = get_block_hasher("sha256_cbor", root=bytes.fromhex(KEYS["none_hash"]))
    got = block_hashes(sequence["token_ids"], KEYS["block_size"], sequence["cache_salt"], hasher)
    assert got == keys(name) and got                  # one key per full block, the partial tail none


def steploop_step() -> ev.KvEventBatch:
    """The events of the golden "steploop_step" batch, as steploop's scheduler records them."""
    bs, plain, long = KEYS["block_size"], keys("plain"), keys("long")
    return ev.KvEventBatch(0, TS, [
        ev.BlockStored(plain, None, tokens("plain")[:2 * bs], bs),
        ev.BlockStored(keys("salted"), None, tokens("plain")[:2 * bs], bs, extra_keys=[("tenant-a",), None]),
        ev.BlockStored(long[1:], long[0], tokens("long")[bs:3 * bs], bs),
        ev.BlockRemoved(plain),
    ])


def test_the_encoder_writes_vllms_bytes(monkeypatch):
    encoder = msgspec.msgpack.Encoder()
    monkeypatch.setattr(zmq_wire, "INT_BLOCK_HASHES", True)
    assert zmq_wire.encode_batch(encoder, steploop_step()) == BATCHES["steploop_step"]["payload"]
    assert zmq_wire.encode_batch(encoder, ev.KvEventBatch(1, TS + 1, [ev.AllBlocksCleared()])) == \
        BATCHES["cleared"]["payload"]
    monkeypatch.setattr(zmq_wire, "INT_BLOCK_HASHES", False)          # STEPLOOP_KV_EVENTS_INT_BLOCK_HASHES=0
    assert zmq_wire.encode_batch(encoder, steploop_step()) == BATCHES["steploop_step_bytes_keys"]["payload"]


def test_the_decoder_reads_every_field_vllm_sends():
    batch = zmq_wire.decode_batch(BATCHES["every_field"]["payload"])
    stored, removed, cleared = batch.events
    low64 = [int.from_bytes(k, "big") & (2**64 - 1) for k in keys("long")]     # vLLM's maybe_convert_block_hash
    assert (batch.ts, batch.data_parallel_rank) == (TS + 2, 2)
    assert isinstance(stored, zmq_wire.BlockStored) and stored.block_hashes == low64
    assert stored.parent_block_hash == int.from_bytes(keys("plain")[1], "big") & (2**64 - 1)
    assert stored.token_ids == tokens("long")[:12] and stored.block_size == KEYS["block_size"]
    assert (stored.lora_id, stored.lora_name, stored.medium) == (3, "sql-adapter", "CPU")
    assert stored.extra_keys == [("sql-adapter",), None, None]
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.locality, stored.session_id) == \
        (1, "full_attention", "LOCAL", "s-1")
    assert isinstance(removed, zmq_wire.BlockRemoved) and removed.block_hashes == low64[:2]
    assert (removed.medium, removed.group_idx, removed.locality) == ("CPU", 1, "LOCAL")
    assert isinstance(cleared, zmq_wire.AllBlocksCleared)
    bytes_keys = zmq_wire.decode_batch(BATCHES["steploop_step_bytes_keys"]["payload"])
    assert bytes_keys.events[0].block_hashes == keys("plain")                  # 32-byte keys decode as bytes
    for golden in BATCHES.values():                       # decode + encode gives vLLM's bytes back, field for field
        assert msgspec.msgpack.encode(zmq_wire.decode_batch(golden["payload"])) == golden["payload"]


def test_the_publisher_sends_vllms_frames(tmp_path, monkeypatch):
    """steploop's ZmqEventPublisher, read back through its replay socket (no slow-joiner loss): vLLM's frames."""
    monkeypatch.setattr(zmq_wire, "INT_BLOCK_HASHES", True)
    publisher = ZmqEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                                                 replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv"))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        publisher.publish(steploop_step())
        publisher.publish(ev.KvEventBatch(1, TS + 1, [ev.AllBlocksCleared()]))
        dealer.connect(f"ipc://{tmp_path}/replay")
        frames: list[list[bytes]] = []
        while len(frames) < 2:                             # asked again until the thread sent both
            frames.clear()
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, topic, seq, payload = dealer.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                frames.append([topic, seq, payload])
        assert frames == [[BATCHES[n]["topic"], BATCHES[n]["seq"], BATCHES[n]["payload"]]
                          for n in ("steploop_step", "cleared")]
    finally:
        dealer.close(linger=0)
        publisher.shutdown()
