"""AffinityMap: the router's guess of where a prefix is cached, for replicas without KV events (and prefixes no
replica reports yet): the schedulers' own block key (services/common/block_hashing.py: chained over full blocks
of the model's block_size tokens, with the request's cache salt) -> the replica that last got a prompt with it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from steploop.common.block_hashing import BlockHasher, block_hashes, get_block_hasher


@dataclass
class AffinityMap:
    """Chained block hashes -> index of the replica that last got a prompt with that prefix (LRU, bounded).
    block_size 0: not known yet, so no prompt has blocks."""
    block_size: int = 0
    capacity: int = 200_000
    hasher: BlockHasher = field(default_factory=get_block_hasher)
    _map: OrderedDict = field(default_factory=OrderedDict)

    def block_hashes(self, prompt_ids: Sequence[int], salt: str = "") -> list[bytes]:
        if not self.block_size:
            return []
        return block_hashes(prompt_ids, self.block_size, salt, self.hasher)

    def deepest(self, hashes: list[bytes]) -> tuple[int, int] | None:
        """(replica, number of blocks matched) of the deepest block already routed, or None."""
        for depth in range(len(hashes), 0, -1):
            replica = self._map.get(hashes[depth - 1])
            if replica is not None:
                return replica, depth
        return None

    def record(self, hashes: list[bytes], replica: int) -> None:
        for h in hashes:
            self._map[h] = replica
            self._map.move_to_end(h)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
