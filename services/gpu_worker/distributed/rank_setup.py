"""What changes in a worker's start-up when it is one rank of a tensor-parallel group.

The C whole-step decoder does not shard (it runs every layer in one C call with no place for the all-reduces), nor
does the packed-weight cache of a dense checkpoint (keyed by the whole checkpoint): a rank of an fp32 / bf16 model
runs its linears in torch on its slices. Weights stored quantized keep their width on every rank: a GGUF file's
blocks are cut and packed per rank (gguf/block_shards.py), a quantized safetensors layer is cut in its common form
(model/quant/shards.py); distributed/stored_split.py refuses at start a split off the blocks / groups. The C
elementwise ops and the C paged-attention kernel work on any head count and stay on. CUDA graphs are off too: a
captured graph would replay collectives on a group that may have been re-formed since.

With -pp N the rank is also one pipeline stage (pipeline.py): its layers only, its own KV cache, the same kernel
plan limits (the C decoder runs every layer of the model in one call; a graph would replay the stage's sends).
"""

from __future__ import annotations

import dataclasses
import logging

from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.distributed.comm import TensorParallelComm
from steploop.gpu_worker.distributed.pipeline import PipelineComm, StageShare, stage_config, stage_share
from steploop.gpu_worker.distributed.shapes import (
    RankShare,
    check_splittable,
    expert_placement,
    local_config,
    rank_share,
)
from steploop.gpu_worker.kernel_plan import KernelPlan
from steploop.gpu_worker.model.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RankSetup:
    share: RankShare | None          # None: world size 1
    comm: TensorParallelComm
    local_cfg: ModelConfig           # the config this rank's layers, attention backend and KV cache are sized by
    stage: StageShare | None = None  # None: no pipeline stages (-pp 1)
    pipe: PipelineComm | None = None

    @classmethod
    def for_worker(cls, config: WorkerConfig, cfg: ModelConfig) -> RankSetup:
        """Checks the shapes split (raises TensorParallelShapeError / PipelineShapeError, before any weight loads)."""
        setup = cls._tensor_parallel(config, cfg, config.rank % config.tensor_parallel_size)
        pp = config.pipeline_parallel_size
        if pp == 1:
            return setup
        if cfg.quant is not None:
            raise ValueError(f"-pp {pp} with a quantized checkpoint ({cfg.quant.describe()}): pipeline stages "
                             "load dense safetensors weights only; run -pp 1")
        stage = stage_share(cfg, config.rank // config.tensor_parallel_size, pp)
        log.info("pipeline stage %d of %d: layers %d-%d%s%s", stage.stage, pp, stage.first_layer,
                 stage.end_layer - 1, ", embedding" if stage.holds_embedding else "",
                 ", final norm + LM head + sampling" if stage.is_last else "")
        return dataclasses.replace(setup, local_cfg=stage_config(setup.local_cfg, stage), stage=stage,
                                   pipe=PipelineComm(config.rank, config.tensor_parallel_size, stage))

    @classmethod
    def _tensor_parallel(cls, config: WorkerConfig, cfg: ModelConfig, tp_rank: int) -> RankSetup:
        size, expert_parallel = config.tensor_parallel_size, config.enable_expert_parallel
        check_splittable(cfg, size, expert_parallel)
        comm = TensorParallelComm(tp_rank, size)
        if size == 1:
            return cls(None, comm, cfg)
        share = rank_share(cfg, tp_rank, size, expert_parallel)
        if expert_parallel:
            log.info("expert parallel over %d ranks, %d experts each: %s", size, share.local_experts,
                     expert_placement(cfg, size))
        elif cfg.moe is not None:
            log.info("mixture of experts sharded over %d ranks: every expert's %d intermediate rows split %d per "
                     "rank", size, cfg.moe.intermediate_size, share.moe_intermediate)
        return cls(share, comm, local_config(cfg, share))

    @property
    def comms(self) -> list[TensorParallelComm]:
        return [self.comm] + ([self.pipe] if self.pipe is not None else [])

    def kernel_plan(self, plan: KernelPlan, gguf: bool = False, half: bool = False) -> KernelPlan:
        """gguf: the weights are a GGUF file's blocks, which a rank packs from its own share of them (no
        packed-weight cache), so a tensor-parallel rank keeps its packed linears. half: the checkpoint holds bf16 /
        fp16 tensors, which a rank or stage keeps at 16 bits from its own share (model/half_weights.py; no cache
        either), so it keeps them too."""
        if self.share is None and self.stage is None:
            return plan
        keep_packed = (gguf and self.stage is None) or half
        why = (f"tensor parallel (-tp {self.share.world_size}): linears run in torch on this rank's slices"
               if self.share is not None else
               f"pipeline stage {self.stage.stage} of {self.stage.num_stages}: this stage's layers only")
        off = [(name, why) for name, on in (("packed linears", plan.packed_linears and not keep_packed),
                                            ("C decoder", plan.cpu_decoder), ("CUDA graphs", plan.cuda_graphs)) if on]
        return dataclasses.replace(plan, packed_linears=plan.packed_linears and keep_packed, cpu_decoder=False,
                                   cuda_graphs=False, why_off=plan.why_off + tuple(off))
