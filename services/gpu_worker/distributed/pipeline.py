"""Pipeline parallelism: which layers a stage holds (StageShare) and what passes between stages (PipelineComm).

A group of tp x pp ranks: rank r is tensor-parallel rank r % tp of stage r // tp. Stage s holds layers
[first_layer, end_layer), a contiguous slice (the earlier stages take one more when the layers do not divide); the
first stage also the embedding, the last the final norm, the LM head and the sampling (and the embedding when the
head is tied to it). Every rank gets the same plan and keeps the same batch state:

    stage s < last    forward its layers, send (hidden, residual) [T, hidden] to the same tp rank of stage s + 1
    stage s > first   receive them from stage s - 1 instead of embedding the ids
    last stage        samples; the stages before it get each sampled token in the plan of the request's next step
                      (StepPlan.stage_token_ids), so no stage waits for the last one within a step

The scheduler keeps one plan in flight per stage, with disjoint batches (scheduler/pipeline_scheduler.py): while
stage 1 runs plan N, stage 0 runs plan N + 1. A gloo send completes only once its receiver posted the receive, so
stage s is at most one plan ahead of stage s + 1. Every send / receive is bounded by the group's timeout (comm.py):
a dead or stopped stage raises CollectiveError on its neighbours, which leave the group, and the scheduler
re-forms it; never a hang.
"""

from __future__ import annotations

import dataclasses

import torch

from steploop.gpu_worker.distributed.comm import TensorParallelComm
from steploop.gpu_worker.model.model_config import ModelConfig

HIDDEN_TAG, RESIDUAL_TAG = 1, 2


class PipelineShapeError(ValueError):
    """-pp N this model cannot be split into."""


@dataclasses.dataclass(frozen=True)
class StageShare:
    stage: int
    num_stages: int
    first_layer: int
    end_layer: int
    tie_word_embeddings: bool = False

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def holds_embedding(self) -> bool:
        return self.is_first or (self.is_last and self.tie_word_embeddings)

    def local_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this stage's model (its layers renumbered from 0), None: not held here."""
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            layer = int(index)
            if not self.first_layer <= layer < self.end_layer:
                return None
            return f"model.layers.{layer - self.first_layer}.{rest}"
        if name.startswith("model.embed_tokens."):
            return name if self.holds_embedding else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.is_last else None
        return name


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    if num_stages > num_layers:
        raise PipelineShapeError(f"-pp {num_stages}: the model has {num_layers} layers, fewer than the stages "
                                 f"(every stage needs at least one layer)")
    base, extra = divmod(num_layers, num_stages)
    bounds, first = [], 0
    for s in range(num_stages):
        end = first + base + (1 if s < extra else 0)
        bounds.append((first, end))
        first = end
    return bounds


def stage_share(cfg: ModelConfig, stage: int, num_stages: int) -> StageShare:
    first, end = stage_layers(cfg.num_hidden_layers, num_stages)[stage]
    return StageShare(stage, num_stages, first, end, cfg.tie_word_embeddings)


def stage_config(cfg: ModelConfig, share: StageShare) -> ModelConfig:
    """The config a stage builds its layers and KV cache from: its own layers only (their true indices kept for
    per-layer windows and sparse layers)."""
    return dataclasses.replace(cfg, num_hidden_layers=share.end_layer - share.first_layer,
                               first_layer=share.first_layer)


class PipelineComm(TensorParallelComm):
    """The whole group's process group (tp x pp ranks), for the stages' point-to-point traffic."""

    def __init__(self, rank: int, tp_size: int, share: StageShare):
        super().__init__(rank, tp_size * share.num_stages)
        self.tp_size, self.share = tp_size, share

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.rank % self.tp_size

    def recv_hidden(self, tokens: int, hidden: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(tokens, hidden, dtype=dtype, device=device)
        residual = torch.zeros_like(x)
        if self.local_only:             # the memory profile: shapes only
            return x, residual
        src = self._peer(self.share.stage - 1)
        self._run(lambda g: g.recv([x], src, HIDDEN_TAG), host_wait=True)
        self._run(lambda g: g.recv([residual], src, RESIDUAL_TAG), host_wait=True)
        return x, residual

    def send_hidden(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        if self.local_only:
            return
        dst = self._peer(self.share.stage + 1)
        x, residual = x.contiguous(), residual.contiguous()
        self._run(lambda g: g.send([x], dst, HIDDEN_TAG), host_wait=True)
        self._run(lambda g: g.send([residual], dst, RESIDUAL_TAG), host_wait=True)
