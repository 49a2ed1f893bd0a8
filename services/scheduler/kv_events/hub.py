"""KvEventHub: numbers each step's KV events, keeps the last `buffer_steps` batches, and hands them to the ZMQ
publisher and to every WatchKVEvents stream.

A watcher that reconnects with (instance_id, from_sequence) this instance still buffers gets exactly the batches
it missed; any other (first connect, a restarted scheduler, a gap older than the buffer) gets a snapshot first:
every key cached now, as of the next sequence, then the batches from that sequence on. Everything runs on the
scheduler's event loop, so taking a snapshot and subscribing happen with no step in between: nothing is lost
or applied twice. A watcher that falls `buffer_steps` batches behind is cut off (it reconnects from a snapshot)
rather than letting its queue grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from steploop.common.pb.steploop.v1 import engine_pb2
from steploop.scheduler.kv_events.config import KvEventsConfig
from steploop.scheduler.kv_events.events import KvEventBatch
from steploop.scheduler.kv_events.recorder import KvEventRecorder

log = logging.getLogger(__name__)


@dataclass
class CacheSnapshot:
    """What the prefix cache holds, for a watcher that starts from nothing."""
    instance_id: str
    sequence: int                        # the next batch's sequence
    block_hashes: list[bytes] = field(default_factory=list)
    block_size: int = 0                  # 0 while no worker ever attached
    hash_algo: str = ""
    hash_root: bytes = b""

    def to_pb(self) -> engine_pb2.KvEventSnapshot:
        return engine_pb2.KvEventSnapshot(instance_id=self.instance_id, sequence=self.sequence,
                                          block_hashes=self.block_hashes, block_size=self.block_size,
                                          hash_algo=self.hash_algo, hash_root=self.hash_root)


def message_pb(item: CacheSnapshot | KvEventBatch) -> engine_pb2.KvEventMessage:
    if isinstance(item, CacheSnapshot):
        return engine_pb2.KvEventMessage(snapshot=item.to_pb())
    return engine_pb2.KvEventMessage(batch=item.to_pb())


class WatcherCutOff(Exception):
    """The watcher fell too far behind; it reconnects and starts from a snapshot."""


class KvEventHub:
    def __init__(self, config: KvEventsConfig, hash_algo: str, hash_root: bytes) -> None:
        self.config, self.hash_algo, self.hash_root = config, hash_algo, hash_root
        self.recorder = KvEventRecorder()
        self.instance_id = uuid.uuid4().hex
        self.next_sequence = 0
        self._buffer: deque[KvEventBatch] = deque(maxlen=config.buffer_steps)
        self._watchers: set[asyncio.Queue] = set()
        self._cache_keys: Callable[[], tuple[list[bytes], int]] = lambda: ([], 0)
        self.publisher = None
        if config.zmq:
            from steploop.scheduler.kv_events.zmq_publisher import ZmqEventPublisher  # optional extra
            self.publisher = ZmqEventPublisher(config)

    def watch_cache(self, cache_keys: Callable[[], tuple[list[bytes], int]]) -> None:
        """Where snapshots come from: () -> (every key cached now, block size). Set when a pool is built."""
        self._cache_keys = cache_keys

    def flush(self) -> KvEventBatch | None:
        """One batch of everything recorded since the last flush (the engine loop calls it once per step)."""
        events = self.recorder.take()
        if not events:
            return None
        batch = KvEventBatch(self.next_sequence, time.time(), events)
        self.next_sequence += 1
        self._buffer.append(batch)
        for watcher in list(self._watchers):
            if watcher.qsize() >= self.config.buffer_steps:
                self._watchers.discard(watcher)
                watcher.put_nowait(None)            # tells it: cut off
            else:
                watcher.put_nowait(batch)
        if self.publisher is not None:
            self.publisher.publish(batch)
        return batch

    def snapshot(self) -> CacheSnapshot:
        self.flush()   # recorded changes get their sequence first, so the snapshot is exactly "as of" it
        keys, block_size = self._cache_keys()
        return CacheSnapshot(self.instance_id, self.next_sequence, list(keys), block_size, self.hash_algo,
                             self.hash_root)

    def resumes(self, instance_id: str, from_sequence: int) -> bool:
        """Whether a watch from (instance_id, from_sequence) gets the missed batches (else a snapshot first)."""
        if instance_id != self.instance_id or from_sequence > self.next_sequence:
            return False
        oldest = self._buffer[0].sequence if self._buffer else self.next_sequence
        return from_sequence >= oldest

    async def watch(self, from_sequence: int, instance_id: str) -> AsyncIterator[CacheSnapshot | KvEventBatch]:
        """A snapshot or the missed batches, then every batch as it is flushed, in order, until cancelled."""
        watcher: asyncio.Queue = asyncio.Queue()
        self._watchers.add(watcher)
        try:
            if self.resumes(instance_id, from_sequence):
                self.flush()
                first: list = [b for b in self._buffer if b.sequence >= from_sequence]
                expected = from_sequence
            else:
                snap = self.snapshot()
                first, expected = [snap], snap.sequence
            for item in first:
                yield item
                if isinstance(item, KvEventBatch):
                    expected = item.sequence + 1
            while True:
                batch = await watcher.get()
                if batch is None:
                    raise WatcherCutOff(f"more than {self.config.buffer_steps} batches behind")
                if batch.sequence >= expected:      # those in the backlog were queued too
                    expected = batch.sequence + 1
                    yield batch
        finally:
            self._watchers.discard(watcher)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
