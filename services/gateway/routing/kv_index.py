"""ReplicaCacheIndex and KvEventWatcher: what each scheduler replica's prefix cache really holds, learned from
its KV events (Engine.WatchKVEvents), so the router sends a prompt where its prefix is cached instead of
guessing from where it sent similar prompts.

One watcher task per replica keeps one stream open. The first message is a snapshot (every key the replica
caches, its block size, and the hash function and root its keys are made with: the router hashes prompts with
the replica's own function and root, so a seed that differs between processes cannot silently match nothing);
then ordered batches of BlockStored / BlockRemoved / AllBlocksCleared. A broken stream reconnects with
(instance_id, next sequence): the replica replays what was missed (its initial metadata says so, and the index
is in sync again at once), or sends a fresh snapshot after a restart.
Until a replica's index is in sync (events off there, stream down) the router guesses for it as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from steploop.common.block_hashing import BlockHasher, block_hashes, get_block_hasher
from steploop.common.engine_contract import KV_EVENTS_RESUMED_METADATA
from steploop.common.pb.steploop.v1 import engine_pb2

logger = logging.getLogger(__name__)

EVENTS_OFF_RETRY_S = 30.0      # a replica with KV events off is asked again this often (it may be restarted with them)
RECONNECT_S = (0.2, 5.0)       # backoff after a broken stream: first, longest


@dataclass
class ReplicaCacheIndex:
    """The keys one replica caches, kept from its snapshot and event batches."""
    keys: set[bytes] = field(default_factory=set)          # in the replica's pool (medium GPU)
    lower_keys: dict[str, set[bytes]] = field(default_factory=dict)   # medium (CPU, DISK) -> keys in that tier
    block_size: int = 0
    hasher: BlockHasher | None = None
    hasher_id: tuple = ()                # (algo, root): replicas with equal ids share a prompt's hashes
    instance_id: str = ""
    next_sequence: int = 0
    synced: bool = False                 # a snapshot was applied (or the replica resumed us) and the stream is up

    def apply(self, message: engine_pb2.KvEventMessage) -> None:
        if message.HasField("snapshot"):
            self._apply_snapshot(message.snapshot)
        elif message.batch.sequence != self.next_sequence:
            raise ValueError(f"KV event batch {message.batch.sequence} after {self.next_sequence - 1}: out of order")
        else:
            self._apply_batch(message.batch)

    def _apply_snapshot(self, snap: engine_pb2.KvEventSnapshot) -> None:
        self.keys = set(snap.block_hashes)
        self.lower_keys = {}
        self.block_size = snap.block_size
        self.hasher_id = (snap.hash_algo, snap.hash_root)
        self.hasher = get_block_hasher(snap.hash_algo, snap.hash_root or None) if snap.hash_algo else None
        self.instance_id, self.next_sequence, self.synced = snap.instance_id, snap.sequence, True

    def _apply_batch(self, batch: engine_pb2.KvEventBatch) -> None:
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                self._medium(event.stored.medium).update(event.stored.block_hashes)
                self.block_size = event.stored.block_size or self.block_size
            elif kind == "removed":
                self._medium(event.removed.medium).difference_update(event.removed.block_hashes)
            elif kind == "cleared":
                self.keys.clear()
                self.lower_keys.clear()
        self.next_sequence = batch.sequence + 1

    def _medium(self, medium: str) -> set[bytes]:
        return self.keys if medium in ("", "GPU") else self.lower_keys.setdefault(medium, set())

    def prompt_hashes(self, prompt_ids: Sequence[int], salt: str, memo: dict) -> list[bytes]:
        """The prompt's block keys as this replica makes them (memo: shared by replicas with equal hashers)."""
        if not self.block_size or self.hasher is None:
            return []
        key = (self.hasher_id, self.block_size)
        if key not in memo:
            memo[key] = block_hashes(prompt_ids, self.block_size, salt or None, self.hasher)
        return memo[key]

    def matched_tokens(self, prompt_ids: Sequence[int], salt: str, memo: dict) -> int:
        """Tokens of the prompt's longest prefix of full blocks this replica caches, in any tier."""
        return self._depth(prompt_ids, salt, memo, [self.keys, *self.lower_keys.values()]) * self.block_size

    def pool_blocks(self, prompt_ids: Sequence[int], salt: str, memo: dict) -> int:
        """The prompt's leading full blocks in this replica's pool (what a cross-replica pull can send)."""
        return self._depth(prompt_ids, salt, memo, [self.keys])

    def _depth(self, prompt_ids: Sequence[int], salt: str, memo: dict, tiers: list[set[bytes]]) -> int:
        depth = 0
        for key in self.prompt_hashes(prompt_ids, salt, memo):
            if not any(key in keys for keys in tiers):
                break
            depth += 1
        return depth


class KvEventWatcher:
    """Keeps one replica's index in sync over WatchKVEvents, reconnecting until stopped."""

    def __init__(self, client, index: ReplicaCacheIndex) -> None:
        self.client, self.index = client, index
        self.events_off = False          # FAILED_PRECONDITION (events off there) or UNIMPLEMENTED (an older one)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.client.address}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        delay = RECONNECT_S[0]
        while True:
            try:
                call = self.client.watch_kv_events(self.index.next_sequence, self.index.instance_id)
                try:
                    if (KV_EVENTS_RESUMED_METADATA, "1") in tuple(await call.initial_metadata() or ()):
                        self.index.synced = True     # only the batches missed while the stream was down follow
                    async for message in call:
                        self.index.apply(message)
                        self.events_off, delay = False, RECONNECT_S[0]
                finally:
                    call.cancel()
            except grpc.aio.AioRpcError as err:
                self.index.synced = False
                if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                    if not self.events_off:
                        logger.info("scheduler %s has KV events off: routing to it by guess", self.client.address)
                    self.events_off = True
                    await asyncio.sleep(EVENTS_OFF_RETRY_S)
                    continue
                logger.debug("KV events from %s broke (%s); reconnecting", self.client.address, err.code())
            except ValueError as err:          # out of order (never expected): start over from a snapshot
                logger.warning("KV events from %s: %s; resyncing", self.client.address, err)
                self.index.instance_id, self.index.synced = "", False
            else:
                self.index.synced = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_S[1])
