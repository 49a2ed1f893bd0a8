"""At start, before any weight loads: a tensor-parallel rank of a quantized checkpoint keeps its weights at their
stored width only if every row-parallel cut (o_proj, down_proj, each expert's down: the input columns) falls on the
format's block or group boundary. A GGUF tensor cut inside its blocks is widened to fp32 on each rank, as the
oracle dequantizes it (exact; that layer's memory grows ~8x) and logged here by name, so that common files whose
FFN width is not a multiple of 256 per rank (Qwen2.5-0.5B/1.5B/3B Q4_K_M at -tp 2) still serve. A GPTQ / AWQ /
compressed-tensors group cut has no such path: it is refused here (exit 2) with the layer and the sizes.

    GGUF                 a block type's blocks along the row: 32 weights (Q4_0 .. Q8_0), 256 (the k-quants)
    GPTQ / AWQ / c-t     the quantization group (group_size > 0); per-channel scales cut anywhere; act-order
                         (g_idx) layers are cut by column whatever their groups (model/quant/shards.py)
    FP8                  per-tensor / per-channel scales: any cut

Column-parallel cuts (whole output rows) and the vocabulary rows fall on a boundary by construction.
"""

from __future__ import annotations

import logging
import pathlib

from steploop.gpu_worker.distributed.shapes import RankShare, TensorParallelShapeError, has_dense_mlp
from steploop.gpu_worker.distributed.sharding import CheckpointSharder
from steploop.gpu_worker.model.model_config import ModelConfig
from steploop.gpu_worker.model.quant.config import INT

log = logging.getLogger(__name__)

_ROW_PARALLEL = ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight")


def check_stored_split(model_path: pathlib.Path, cfg: ModelConfig, share: RankShare | None) -> None:
    """Raises TensorParallelShapeError naming every misfit (cfg: the whole model's config)."""
    from steploop.gpu_worker.gguf.weights import gguf_source
    if share is None:
        return
    sharder = CheckpointSharder(cfg, share)
    gguf = gguf_source(model_path)
    if gguf is not None:
        misfits = gguf_misfits(gguf, model_path, sharder)
        if misfits:
            log.warning("-tp %d cuts %d GGUF tensors inside their blocks; each rank holds its share of them as "
                        "fp32 (exact, ~8x their stored bytes): %s", share.world_size, len(misfits),
                        "; ".join(misfits[:4]) + (f"; and {len(misfits) - 4} more" if len(misfits) > 4 else ""))
        return
    if cfg.quant is None:
        return
    if cfg.moe is not None:
        raise TensorParallelShapeError(f"-tp {share.world_size} with a quantized mixture-of-experts checkpoint "
                                       f"({cfg.quant.describe()}): its experts are read at their stored width on "
                                       "unsharded workers only for now; run -tp 1")
    misfits = group_misfits(cfg, sharder)
    fix = "run a -tp whose cut falls on a group boundary, or -tp 1"
    if misfits:
        shown = "; ".join(misfits[:4]) + (f"; and {len(misfits) - 4} more" if len(misfits) > 4 else "")
        raise TensorParallelShapeError(f"-tp {share.world_size}: a row-parallel layer's input columns would be cut "
                                       f"inside a quantization block or group, so a rank could not keep them at "
                                       f"their stored width: {shown}. {fix}")


def gguf_misfits(gguf_path: pathlib.Path, folder: pathlib.Path, sharder: CheckpointSharder) -> list[str]:
    from steploop.gpu_worker.gguf.block_shards import block_size, cut_inside_blocks
    from steploop.gpu_worker.gguf.reader import open_gguf
    from steploop.gpu_worker.gguf.weights import _split_experts, hf_name_map
    names = hf_name_map(folder)
    out = []
    for tensor in open_gguf(gguf_path).tensors:
        hf = names.get(tensor.name)
        if hf is None or block_size(tensor.tensor_type) == 1:
            continue
        name = _split_experts(tensor, hf)[0][1]                     # the experts of a stacked tensor cut alike
        if cut_inside_blocks(sharder, name, tensor.tensor_type):     # the loader's own test (gguf/weights.py)
            split, k = sharder.split(name), int(tensor.shape[0])
            out.append(f"{tensor.name} ({tensor.tensor_type.name}, blocks of {block_size(tensor.tensor_type)}): "
                       f"{k} input columns, {split[2]} per rank")
    return out


def group_misfits(cfg: ModelConfig, sharder: CheckpointSharder) -> list[str]:
    scheme = cfg.quant
    if scheme.kind != INT or scheme.group_size == -1 or scheme.desc_act:
        return []
    out = []
    for name in _ROW_PARALLEL if has_dense_mlp(cfg) else _ROW_PARALLEL[:1]:
        split = sharder.split(name)
        if split is not None and (split[1] % scheme.group_size or split[2] % scheme.group_size):
            k = sharder.full_shape(name)[1]
            out.append(f"{name.rsplit('.', 2)[-2]} ({scheme.describe()}): {k} input columns, {split[2]} per rank")
    return out
