"""KV events through `steploop serve` as llm-d deploys them: the collector binds one SUB socket and every engine
connects its PUB socket to it (`"endpoint": "tcp://127.0.0.1:PORT"`, vLLM's convention for a non-wildcard
address), while the replay ROUTER socket stays bound on the engine."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from steploop.scheduler.kv_events.zmq_wire import BlockStored, decode_batch
from tests.integration.cluster import MODEL
from tests.integration.serve_process import ServeProcess, free_port

pytestmark = pytest.mark.slow


def test_a_subscriber_that_binds_receives_batches_from_serve(tmp_path):
    pub, replay = free_port(), free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    serve = ServeProcess(tmp_path, "--num-kv-blocks", "600", "--kv-events-config", json.dumps(config),
                         "--prefix-caching-hash-algo", "sha256_cbor")
    try:
        serve.wait_ready(600)
        sub.bind(f"tcp://127.0.0.1:{pub}")      # the collector binds (after the engine started); the engine connects
        received, i = None, 0
        deadline = time.monotonic() + 120
        while received is None:     # ZMQ's slow joiner: completions until one's batch arrives, or the deadline
            assert time.monotonic() < deadline, f"no KV event batch received\n{serve.log()[-3000:]}"
            status, body = serve.cluster.post("/v1/completions", {"model": MODEL, "prompt": [1000 + i] * 40,
                                                                  "max_tokens": 1})
            assert status == 200, body
            if sub.poll(2000):
                received = sub.recv_multipart()
            i += 1
        topic, seq, payload = received
        assert topic == b"kv" and int.from_bytes(seq, "big") == 0     # held until the collector listened: none lost
        assert any(isinstance(e, BlockStored) and e.block_hashes for e in decode_batch(payload).events)
        replay_socket = zmq.Context.instance().socket(zmq.DEALER)      # the replay socket is bound on the engine
        try:
            replay_socket.connect(f"tcp://127.0.0.1:{replay}")
            replay_socket.send_multipart((b"", seq))
            assert replay_socket.poll(30_000), "no replay answer"
            assert replay_socket.recv_multipart() == [b"", b"kv", seq, payload]
        finally:
            replay_socket.close(linger=0)
    finally:
        sub.close(linger=0)
        serve.kill()
