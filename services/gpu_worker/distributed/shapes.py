"""Which tensor-parallel sizes a model's shapes allow, and each rank's share of the heads.

Checked from config.json alone, before any weight loads, so a size that cannot split is refused at once (exit 2)
with the numbers and the sizes that would work. Query heads and the MLP's intermediate size must divide by N; KV
heads either divide by N, or N is a multiple of them, and then each KV head is replicated on N / num_kv_heads
ranks (vLLM's rule), so every rank still holds whole heads. The vocabulary need not divide: it is padded.
"""

from __future__ import annotations

import dataclasses

from steploop.gpu_worker.model.model_config import ModelConfig


class TensorParallelShapeError(ValueError):
    """The model's shapes cannot be split across the requested number of ranks."""


def kv_heads_split(num_kv_heads: int, world_size: int) -> bool:
    return num_kv_heads % world_size == 0 or world_size % num_kv_heads == 0


def why_not_splittable(cfg: ModelConfig, world_size: int) -> list[str]:
    """The reasons this model cannot run at tensor-parallel size `world_size` (empty: it can)."""
    why = []
    if cfg.num_attention_heads % world_size:
        why.append(f"{cfg.num_attention_heads} attention heads do not divide by {world_size}")
    if not kv_heads_split(cfg.num_key_value_heads, world_size):
        why.append(f"{cfg.num_key_value_heads} KV heads neither divide by {world_size} nor divide it")
    if cfg.intermediate_size % world_size:
        why.append(f"intermediate size {cfg.intermediate_size} does not divide by {world_size}")
    if world_size > 1 and cfg.moe is not None:
        why.append("mixture-of-experts layers are not sharded yet")
    if world_size > 1 and cfg.qk_norm == "full":
        why.append("a q/k norm over the whole projection (not per head) is not sharded")
    return why


def sizes_that_work(cfg: ModelConfig) -> list[int]:
    return [n for n in range(1, cfg.num_attention_heads + 1) if not why_not_splittable(cfg, n)]


def check_splittable(cfg: ModelConfig, world_size: int) -> None:
    """Raises TensorParallelShapeError naming the numbers and the sizes that would work."""
    if world_size < 1:
        raise TensorParallelShapeError(f"-tp {world_size}: the tensor-parallel size must be at least 1")
    why = why_not_splittable(cfg, world_size)
    if why:
        sizes = ", ".join(str(n) for n in sizes_that_work(cfg))
        raise TensorParallelShapeError(f"-tp {world_size}: {'; '.join(why)} ({cfg.model_type}: "
                                       f"{cfg.num_attention_heads} attention heads, {cfg.num_key_value_heads} KV "
                                       f"heads, intermediate size {cfg.intermediate_size}); tensor-parallel sizes "
                                       f"that divide: {sizes}")


@dataclasses.dataclass(frozen=True)
class RankShare:
    """One rank's slice of every split dimension."""

    rank: int
    world_size: int
    num_heads: int          # query heads on this rank
    num_kv_heads: int       # KV heads on this rank (1 when replicated)
    first_head: int         # first query head
    first_kv_head: int      # first KV head (the replicated one, when N > num_kv_heads)
    intermediate: int       # MLP intermediate rows on this rank
    vocab_rows: int         # embedding / LM head rows on this rank (the padded vocab / N)

    @property
    def first_vocab_row(self) -> int:
        return self.rank * self.vocab_rows


def rank_share(cfg: ModelConfig, rank: int, world_size: int) -> RankShare:
    check_splittable(cfg, world_size)
    heads, kv = cfg.num_attention_heads // world_size, cfg.num_key_value_heads
    if kv % world_size == 0:
        local_kv, first_kv = kv // world_size, rank * (kv // world_size)
    else:
        local_kv, first_kv = 1, rank // (world_size // kv)
    return RankShare(rank, world_size, heads, local_kv, rank * heads, first_kv,
                     cfg.intermediate_size // world_size, -(-cfg.vocab_size // world_size))


def local_config(cfg: ModelConfig, share: RankShare) -> ModelConfig:
    """The config a rank builds its layers from: its heads, KV heads, MLP rows and vocabulary rows."""
    return dataclasses.replace(cfg, num_attention_heads=share.num_heads, num_key_value_heads=share.num_kv_heads,
                               intermediate_size=share.intermediate, vocab_size=share.vocab_rows)
