"""Which KV heads each tensor-parallel rank holds, and KV blocks made whole from the ranks' shares or cut back into
them (head axis -2 of [..., block_size, heads, head_dim]).

The KV tiers stay per rank: each rank stores and loads its own heads, so a slot is the rank's share. What leaves or
enters a group (a P/D transfer, a cross-replica pull) carries every KV head: rank 0 gathers the others' shares and
sends whole blocks; a receiving group's rank 0 broadcasts whole blocks and each rank keeps its heads. So groups of
any two -tp sizes exchange blocks, and a group of one sends exactly what it holds.

The split follows distributed/shapes.rank_share: N ranks over H KV heads hold H/N each when N divides H; when H
divides N each rank holds one, replicated on N/H ranks (the whole block takes each head from its first holder).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvHeads:
    total: int          # the model's KV heads
    world_size: int     # tensor-parallel ranks of this group

    def __post_init__(self) -> None:
        if self.total % self.world_size and self.world_size % self.total:
            raise ValueError(f"{self.total} KV heads do not split over {self.world_size} ranks")

    @property
    def per_rank(self) -> int:
        return max(1, self.total // self.world_size)

    def first(self, rank: int) -> int:
        if self.world_size <= self.total:
            return rank * self.per_rank
        return rank // (self.world_size // self.total)

    def whole(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The ranks' shares (rank order) as whole blocks: every head once, from its first holder."""
        if len(parts) == 1:
            return parts[0]
        keep = [part for rank, part in enumerate(parts)
                if rank == 0 or self.first(rank) != self.first(rank - 1)]
        return torch.cat(keep, dim=-2)

    def mine(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's heads of whole blocks (a view)."""
        first = self.first(rank)
        return whole[..., first:first + self.per_rank, :]
