"""KvEventRecorder: the prefix cache's changes since the last take(), in order. The block pool and KV manager
call it only when KV events are on (they hold None otherwise, so a step with events off costs one `is None`
test per keyed or evicted block). The engine loop takes the events once per step (hub.py)."""

from __future__ import annotations

from collections.abc import Sequence

from steploop.common.block_hashing import block_images
from steploop.scheduler.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from steploop.scheduler.prefix_cache import block_tokens


class KvEventRecorder:
    def __init__(self) -> None:
        self.pending: list[KvEvent] = []

    def stored(self, request, indices: Sequence[int], hashes: Sequence[bytes], block_size: int) -> None:
        """Blocks `indices` of `request` (its keys `hashes`) entered the prefix cache: one BlockStored per run
        of consecutive blocks (a block already cached under another id breaks a run, as it is not stored)."""
        run: list[int] = []
        for i in indices:
            if run and i != run[-1] + 1:
                self._stored_run(request, run, hashes, block_size)
                run = []
            run.append(i)
        self._stored_run(request, run, hashes, block_size)

    def _stored_run(self, request, run: list[int], hashes: Sequence[bytes], block_size: int) -> None:
        first = run[0]
        tokens = [t for i in run for t in block_tokens(request, i, block_size)]
        extra = [_extra_keys(request, i, block_size) for i in run]
        extra = extra if any(e is not None for e in extra) else None
        self.pending.append(BlockStored([hashes[i] for i in run], hashes[first - 1] if first else None, tokens,
                                        block_size, extra))

    def removed(self, key: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved) and last.medium == MEDIUM_GPU:   # one allocation's evictions: one event
            last.block_hashes.append(key)
        else:
            self.pending.append(BlockRemoved([key]))

    def tier_stored(self, key: bytes, block_size: int, medium: str) -> None:
        """A block entered a KV tier below the pool (medium "CPU" or "DISK"); as vLLM's offloading connector,
        without tokens or parent (the key alone names the prefix)."""
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockStored) and last.medium == medium and not last.token_ids:
            last.block_hashes.append(key)
        else:
            self.pending.append(BlockStored([key], None, [], block_size, medium=medium))

    def tier_removed(self, key: bytes, medium: str) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(key)
        else:
            self.pending.append(BlockRemoved([key], medium))

    def cleared(self) -> None:
        self.pending = [AllBlocksCleared()]      # what came before is moot: the cache is empty now

    def take(self) -> list[KvEvent]:
        events, self.pending = self.pending, []
        return events


def _extra_keys(request, index: int, block_size: int) -> tuple | None:
    """vLLM's untagged extra keys of one block: the hashes of the images it meets, then the cache salt on the block
    that hashed it (block 0); None when it has none."""
    images = block_images([(f.hash, f.offset, f.length) for f in request.mm_features], index * block_size,
                          (index + 1) * block_size) if getattr(request, "mm_features", None) else ()
    salt = (request.cache_salt,) if index == 0 and request.cache_salt else ()
    return (*images, *salt) or None
