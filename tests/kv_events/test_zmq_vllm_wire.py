"""The ZMQ publisher speaks vLLM's wire format: a subscriber written as vLLM's consumers are, decoding with the wire
classes (services/scheduler/kv_events/zmq_wire.py, checked field for field against bytes vLLM itself sent in
test_vllm_golden.py), sees one BlockStored entry per full block with the sha256_cbor hashes this test computes,
BlockRemoved on eviction, and recovers a gap through the replay ROUTER socket. Both of vLLM's endpoint forms
deliver: the publisher binds tcp://*:P, or connects to tcp://host:P where a collector bound its SUB socket."""

from __future__ import annotations

import time

import pytest
import zmq

from steploop.scheduler.kv_events.zmq_wire import BlockRemoved, BlockStored, KVEventBatch, decode_batch
from tests.integration.cluster import free_port
from tests.kv_events.helpers import expected_chain, low64, make_hub, run_prompt

END_SEQ = -1


class Subscriber:
    """vLLM's consumer pattern: SUB for live batches; on a sequence gap, ask the replay socket from the missing
    sequence and read (topic, seq, payload) until the end marker."""

    def __init__(self, pub_port: int, replay_port: int) -> None:
        self.ctx, self.pub_port, self.replay_port = zmq.Context.instance(), pub_port, replay_port
        self.sub = self._subscribe()
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
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
            self.batches[seq] = decode_batch(payload)
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
            self.batches[seq] = decode_batch(payload)
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
    other = Subscriber(sub.pub_port, sub.replay_port)           # another collector keeps listening (the publisher
    try:                                                    # holds batches only while no one does)
        pump_until_received(hub, kv, other, start=41500)
        sub.disconnect()                                    # this subscriber misses what follows
        missed = []
        for i in range(3):
            run_prompt(kv, f"m{i}", [60000 + i] * 4)
            missed.append(hub.flush().sequence)
        wait_until(lambda: hub.publisher.last_sent >= missed[-1], "the missed batches were never sent")
    finally:
        other.close()
    sub.reconnect()
    pump_until_received(hub, kv, sub, start=42000)           # the next live batch reveals the gap
    assert sub.replayed >= len(missed)
    for i, seq in enumerate(missed):
        (event,) = [e for e in sub.batches[seq].events if isinstance(e, BlockStored)]
        assert event.block_hashes == [low64(h) for h in expected_chain([60000 + i] * 4, 4)]
    assert sorted(sub.batches) == list(range(min(sub.batches), sub.next_seq))   # nothing missing from there


def wait_until(condition, message: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.005)                                   # a poll interval


@pytest.mark.parametrize("form", ["publisher binds", "subscriber binds"])
def test_the_first_batch_reaches_a_subscriber_of_either_endpoint_form(form):
    """vLLM's two forms: tcp://*:P binds (subscribers connect); tcp://127.0.0.1:P connects to a collector's bound
    SUB socket, which subscribes only once its owner polls it: the batch published before that is held, not lost."""
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if form == "subscriber binds":
        sub.bind(f"tcp://127.0.0.1:{port}")
    hub, kv = make_hub(num_blocks=6, block_size=4, publisher="zmq",
                       endpoint=f"tcp://*:{port}" if form == "publisher binds" else f"tcp://127.0.0.1:{port}")
    try:
        if form == "publisher binds":
            sub.connect(f"tcp://127.0.0.1:{port}")
        run_prompt(kv, "only", list(range(7, 15)))
        assert hub.flush().sequence == 0
        assert sub.poll(10_000), "the first batch never arrived"
        topic, seq, payload = sub.recv_multipart()
        (stored,) = decode_batch(payload).events
        assert (topic, int.from_bytes(seq, "big")) == (b"", 0)
        assert stored.block_hashes == [low64(h) for h in expected_chain(list(range(7, 15)), 4)]
    finally:
        sub.close(linger=0)
        hub.close()


def test_kv_events_config_is_vllms_json():
    from steploop.scheduler.kv_events.config import KvEventsConfig, KvEventsConfigError
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

    from steploop.common.block_hashing import get_block_hasher
    from steploop.scheduler.kv_events.config import KvEventsConfig, KvEventsConfigError
    monkeypatch.setitem(sys.modules, "zmq", None)          # as if pyzmq were not installed
    with pytest.raises(KvEventsConfigError, match=r"pyzmq.*steploop\[kv-events\]"):
        KvEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert not KvEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').zmq
    monkeypatch.setitem(sys.modules, "cbor2", None)
    with pytest.raises(ValueError, match=r"cbor2.*steploop\[kv-events\]"):
        get_block_hasher("sha256_cbor")
