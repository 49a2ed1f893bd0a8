"""ZmqEventPublisher: vLLM's reliable PUB/ROUTER publisher (vllm/distributed/kv_events.py ZmqEventPublisher,
vLLM 0.32.0), so vLLM's subscribers (its examples/online_serving/kv_events_subscriber.py, llm-d, Dynamo) read a
steploop scheduler unchanged:

- PUB `endpoint`: every batch as the multipart message (topic, sequence as 8-byte big-endian, msgpack payload);
  vLLM's rule decides the side: a wildcard (tcp://*:P), `::`, ipc:// or inproc:// address binds, any other
  (tcp://host:P) connects to a collector that binds its SUB socket there (llm-d's deployment);
- ROUTER `replay_endpoint` (always bound): a request (identity, b"", start sequence as 8-byte big-endian) is
  answered with each buffered batch from that sequence on as (identity, b"", topic, seq, payload), then the end
  marker (identity, b"", b"", -1 as 8 signed big-endian bytes, b"");
- the last `buffer_steps` payloads are kept for replay; the PUB socket's high-water mark is `hwm`.

Unlike vLLM, batches are not dropped while no subscriber listens for the topic: the PUB side is an XPUB socket,
which reports subscriptions, and batches published while none matches are held (in the replay buffer) and sent
when one arrives. A SUB socket that binds only subscribes once its owner calls into it (a poll or recv), so with
vLLM's plain PUB a connecting publisher loses every batch sent before that moment: a collector that binds, lets
a completion run and then reads got nothing at all.

The step loop only puts batches on a bounded queue (`max_queue_size`; past it a batch is dropped and logged,
never blocking a step); one thread owns both sockets (ZMQ sockets are not thread-safe) and does the encoding.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from steploop.scheduler.kv_events.config import KvEventsConfig
from steploop.scheduler.kv_events.events import KvEventBatch
from steploop.scheduler.kv_events.zmq_wire import encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's convention: bind wildcard and ipc/inproc endpoints (stable side), connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KvEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config, self.data_parallel_rank = config, data_parallel_rank
        self._queue: queue.Queue[KvEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.dropped = 0
        self.last_sent = -1                  # the last sequence sent on the PUB socket (the thread's progress)
        self._subscriptions: set[bytes] = set()   # prefixes subscribed now (XPUB reports the first and the last)
        self._held_from: int | None = None   # the first buffered sequence no subscriber has been sent
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.XPUB)
        self._pub.set_hwm(config.hwm)
        (self._pub.bind if is_bind_endpoint(config.endpoint) else self._pub.connect)(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-zmq")
        self._thread.start()
        log.info("KV events: ZMQ PUB on %s%s", config.endpoint,
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, batch: KvEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            log.warning("KV events: ZMQ queue full (max_queue_size %d); batch %d dropped (replay cannot recover "
                        "it; WatchKVEvents still has it)", self.config.max_queue_size, batch.sequence)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._service_replay()
                except zmq.ZMQError:
                    log.exception("KV events: replay request failed")
            self._read_subscriptions()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            self._buffer.append((batch.sequence, encode_batch(encoder, batch, self.data_parallel_rank)))
            if self._held_from is None:
                self._held_from = batch.sequence
            if self._has_subscriber():
                self._send_held()

    def _has_subscriber(self) -> bool:
        return any(self._topic.startswith(prefix) for prefix in self._subscriptions)

    def _read_subscriptions(self) -> None:
        """XPUB's subscription messages: 1 + prefix for a prefix's first subscriber, 0 + prefix when its last one
        leaves."""
        while self._pub.poll(0):
            message = self._pub.recv()
            if message[:1] == b"\x01":
                self._subscriptions.add(message[1:])
            elif message[:1] == b"\x00":
                self._subscriptions.discard(message[1:])
        if self._held_from is not None and self._has_subscriber():
            self._send_held()

    def _send_held(self) -> None:
        """Every buffered batch from the first held one on, oldest first (usually just the newest)."""
        held = []
        for seq, payload in reversed(self._buffer):
            if seq < self._held_from:
                break
            held.append((seq, payload))
        for seq, payload in reversed(held):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self.last_sent = seq
        self._held_from = None

    def _service_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        """Publish what is queued (up to SHUTDOWN_TIMEOUT_S), then close both sockets."""
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
