"""Which tensor-parallel sizes a model's shapes allow, and each rank's share of the heads.

Checked from config.json alone, before any weight loads, so a size that cannot split is refused at once (exit 2)
with the numbers and the sizes that would work. Query heads and the MLP's intermediate size must divide by N; KV
heads either divide by N, or N is a multiple of them, and then each KV head is replicated on N / num_kv_heads
ranks (vLLM's rule), so every rank still holds whole heads. The vocabulary need not divide: it is padded.

Mixture-of-experts layers: sharded (the default), every expert's intermediate size (and the shared expert's) must
divide by N; expert parallel (--enable-expert-parallel), the experts must divide by N (each rank holds a contiguous
E / N of them, whole) and the shared expert's intermediate size still must (it is sharded in both modes).
"""

from __future__ import annotations

import dataclasses

from steploop.gpu_worker.model.model_config import ModelConfig
from steploop.gpu_worker.model.moe import MoESpec


class TensorParallelShapeError(ValueError):
    """The model's shapes cannot be split across the requested number of ranks."""


def kv_heads_split(num_kv_heads: int, world_size: int) -> bool:
    return num_kv_heads % world_size == 0 or world_size % num_kv_heads == 0


def has_dense_mlp(cfg: ModelConfig) -> bool:
    return cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_hidden_layers


def why_not_splittable(cfg: ModelConfig, world_size: int, expert_parallel: bool = False) -> list[str]:
    """The reasons this model cannot run at tensor-parallel size `world_size` (empty: it can)."""
    why = []
    if cfg.num_attention_heads % world_size:
        why.append(f"{cfg.num_attention_heads} attention heads do not divide by {world_size}")
    if not kv_heads_split(cfg.num_key_value_heads, world_size):
        why.append(f"{cfg.num_key_value_heads} KV heads neither divide by {world_size} nor divide it")
    if has_dense_mlp(cfg) and cfg.intermediate_size % world_size:
        why.append(f"intermediate size {cfg.intermediate_size} does not divide by {world_size}")
    if cfg.moe is not None:
        why += _why_moe_not_splittable(cfg.moe, world_size, expert_parallel)
    if world_size > 1 and cfg.qk_norm == "full":
        why.append("a q/k norm over the whole projection (not per head) is not sharded")
    return why


def _why_moe_not_splittable(moe: MoESpec, world_size: int, expert_parallel: bool) -> list[str]:
    why = []
    if expert_parallel and moe.num_experts % world_size:
        why.append(f"--enable-expert-parallel: {moe.num_experts} experts do not divide by {world_size} ranks")
    if not expert_parallel and moe.intermediate_size % world_size:
        why.append(f"expert intermediate size {moe.intermediate_size} does not divide by {world_size}")
    if moe.shared_intermediate_size % world_size:
        why.append(f"shared expert intermediate size {moe.shared_intermediate_size} does not divide by {world_size}")
    return why


def sizes_that_work(cfg: ModelConfig, expert_parallel: bool = False) -> list[int]:
    return [n for n in range(1, cfg.num_attention_heads + 1) if not why_not_splittable(cfg, n, expert_parallel)]


def check_splittable(cfg: ModelConfig, world_size: int, expert_parallel: bool = False) -> None:
    """Raises TensorParallelShapeError naming the numbers and the sizes that would work."""
    if world_size < 1:
        raise TensorParallelShapeError(f"-tp {world_size}: the tensor-parallel size must be at least 1")
    if expert_parallel and cfg.moe is None:
        raise TensorParallelShapeError(f"--enable-expert-parallel: {cfg.model_type} has no mixture-of-experts "
                                       "layers to place across ranks")
    if expert_parallel and world_size == 1:
        raise TensorParallelShapeError("--enable-expert-parallel needs -tp 2 or more: the experts are placed "
                                       "across the group's ranks")
    why = why_not_splittable(cfg, world_size, expert_parallel)
    if why:
        sizes = ", ".join(str(n) for n in sizes_that_work(cfg, expert_parallel))
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
    moe_intermediate: int = 0       # each routed expert's gate/up rows on this rank (its whole size: expert parallel)
    shared_intermediate: int = 0    # the shared expert's gate/up rows on this rank
    first_expert: int = 0           # expert parallel: the experts [first_expert, + local_experts) live here
    local_experts: int = 0          # 0: every expert (sharded)

    @property
    def expert_parallel(self) -> bool:
        return self.local_experts > 0

    @property
    def first_vocab_row(self) -> int:
        return self.rank * self.vocab_rows


def rank_share(cfg: ModelConfig, rank: int, world_size: int, expert_parallel: bool = False) -> RankShare:
    check_splittable(cfg, world_size, expert_parallel)
    heads, kv = cfg.num_attention_heads // world_size, cfg.num_key_value_heads
    if kv % world_size == 0:
        local_kv, first_kv = kv // world_size, rank * (kv // world_size)
    else:
        local_kv, first_kv = 1, rank // (world_size // kv)
    experts = {}
    if cfg.moe is not None:
        held = cfg.moe.num_experts // world_size if expert_parallel else 0
        experts = {"moe_intermediate": cfg.moe.intermediate_size // (1 if expert_parallel else world_size),
                   "shared_intermediate": cfg.moe.shared_intermediate_size // world_size,
                   "first_expert": rank * held, "local_experts": held}
    return RankShare(rank, world_size, heads, local_kv, rank * heads, first_kv,
                     cfg.intermediate_size // world_size, -(-cfg.vocab_size // world_size), **experts)


def local_moe_spec(moe: MoESpec, share: RankShare) -> MoESpec:
    return dataclasses.replace(moe, intermediate_size=share.moe_intermediate,
                               shared_intermediate_size=share.shared_intermediate, first_expert=share.first_expert,
                               local_experts=share.local_experts)


def expert_placement(cfg: ModelConfig, world_size: int) -> str:
    """Expert parallel's contiguous placement, for the start-up log: 'rank 0: experts 0-3, rank 1: 4-7'."""
    held = cfg.moe.num_experts // world_size
    return ", ".join(f"rank {r}: experts {r * held}-{(r + 1) * held - 1}" for r in range(world_size))


def local_config(cfg: ModelConfig, share: RankShare) -> ModelConfig:
    """The config a rank builds its layers from: its heads, KV heads, MLP rows, experts and vocabulary rows."""
    moe = None if cfg.moe is None else local_moe_spec(cfg.moe, share)
    return dataclasses.replace(cfg, num_attention_heads=share.num_heads, num_key_value_heads=share.num_kv_heads,
                               intermediate_size=share.intermediate, vocab_size=share.vocab_rows, moe=moe)
