"""Mixture-of-experts models under -tp N: which sizes split (sharded or expert parallel), the refusals' messages,
each rank's share of the experts, and the checkpoint slices the loader copies (tests/tp/test_moe_tp.py runs them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from steploop.gpu_worker.distributed.shapes import (
    TensorParallelShapeError,
    check_splittable,
    expert_placement,
    local_config,
    rank_share,
    sizes_that_work,
)
from steploop.gpu_worker.distributed.sharding import CheckpointSharder
from steploop.gpu_worker.model.moe import NOT_HELD, MoESpec, expert_target
from tests.tp.test_shapes import SMOLLM

# Qwen2-MoE-like: 8 heads / 2 KV, 6 experts of 64 rows, a shared expert of 96, dense layer 1 of 192 rows
QWEN2_MOE = dataclasses.replace(
    SMOLLM, num_attention_heads=8, num_key_value_heads=2, intermediate_size=192, num_hidden_layers=2,
    model_type="qwen2_moe", moe=MoESpec(num_experts=6, top_k=2, intermediate_size=64, renormalize=True,
                                        module="mlp", sparse_layers=(0,), shared_intermediate_size=96))


def test_sharded_and_expert_parallel_sizes():
    assert sizes_that_work(QWEN2_MOE) == [1, 2, 4, 8]            # 64, 96 and 192 rows divide by 2, 4, 8
    assert sizes_that_work(QWEN2_MOE, expert_parallel=True) == [1, 2]   # 6 experts: not by 4 or 8


def test_expert_count_not_dividing_is_refused_naming_it():
    with pytest.raises(TensorParallelShapeError, match="--enable-expert-parallel: 6 experts do not divide by 4 "
                                                       "ranks") as err:
        check_splittable(QWEN2_MOE, 4, expert_parallel=True)
    assert str(err.value).endswith("sizes that divide: 1, 2")


def test_expert_rows_not_dividing_is_refused_unless_expert_parallel():
    odd = dataclasses.replace(QWEN2_MOE, moe=dataclasses.replace(QWEN2_MOE.moe, intermediate_size=60,
                                                                 shared_intermediate_size=0))
    with pytest.raises(TensorParallelShapeError, match="expert intermediate size 60 does not divide by 8"):
        check_splittable(odd, 8)
    check_splittable(dataclasses.replace(odd, moe=dataclasses.replace(odd.moe, num_experts=8)), 8,
                     expert_parallel=True)       # whole experts: their rows need not divide
    shared = dataclasses.replace(QWEN2_MOE, moe=dataclasses.replace(QWEN2_MOE.moe, shared_intermediate_size=90))
    with pytest.raises(TensorParallelShapeError, match="shared expert intermediate size 90 does not divide by 4"):
        check_splittable(shared, 4, expert_parallel=False)


def test_expert_parallel_needs_ranks_and_experts():
    with pytest.raises(TensorParallelShapeError, match="needs -tp 2 or more"):
        check_splittable(QWEN2_MOE, 1, expert_parallel=True)
    with pytest.raises(TensorParallelShapeError, match="no mixture-of-experts layers"):
        check_splittable(SMOLLM, 3, expert_parallel=True)


def test_rank_shares_of_the_experts():
    sharded = [rank_share(QWEN2_MOE, r, 2) for r in range(2)]
    assert [(s.moe_intermediate, s.shared_intermediate, s.local_experts) for s in sharded] == [(32, 48, 0)] * 2
    local = local_config(QWEN2_MOE, sharded[1]).moe
    assert (local.num_experts, local.held_experts, local.intermediate_size) == (6, 6, 32)
    ep = [rank_share(QWEN2_MOE, r, 2, expert_parallel=True) for r in range(2)]
    assert [(s.first_expert, s.local_experts, s.moe_intermediate, s.shared_intermediate) for s in ep] == \
        [(0, 3, 64, 48), (3, 3, 64, 48)]
    local = local_config(QWEN2_MOE, ep[1]).moe
    assert (local.num_experts, local.held_experts, local.first_expert) == (6, 3, 3)
    assert expert_placement(QWEN2_MOE, 2) == "rank 0: experts 0-2, rank 1: experts 3-5"


def test_sharder_slices_each_expert_and_the_shared_expert():
    share = rank_share(QWEN2_MOE, 1, 2)
    sharder = CheckpointSharder(QWEN2_MOE, share)
    gate = torch.arange(64 * 4).reshape(64, 4)
    assert torch.equal(sharder.shard("model.layers.0.mlp.experts.5.gate_proj.weight", gate), gate[32:])
    assert torch.equal(sharder.shard("model.layers.0.block_sparse_moe.experts.0.w3.weight", gate), gate[32:])
    down = torch.arange(4 * 64).reshape(4, 64)
    assert torch.equal(sharder.shard("model.layers.0.block_sparse_moe.experts.2.w2.weight", down), down[:, 32:])
    shared_up = torch.arange(96 * 4).reshape(96, 4)
    assert torch.equal(sharder.shard("model.layers.0.mlp.shared_expert.up_proj.weight", shared_up), shared_up[48:])
    router = torch.ones(6, 4)
    assert sharder.shard("model.layers.0.mlp.gate.weight", router) is router
    assert sharder.shard("model.layers.0.mlp.shared_expert_gate.weight", router) is router
    ep = CheckpointSharder(QWEN2_MOE, rank_share(QWEN2_MOE, 1, 2, expert_parallel=True))
    assert ep.shard("model.layers.0.mlp.experts.5.gate_proj.weight", gate) is gate       # whole experts
    assert torch.equal(ep.shard("model.layers.0.mlp.shared_expert.up_proj.weight", shared_up), shared_up[48:])


def test_expert_targets_on_an_expert_parallel_rank():
    spec = local_config(QWEN2_MOE, rank_share(QWEN2_MOE, 1, 2, expert_parallel=True)).moe
    assert expert_target("model.layers.0.mlp.experts.1.up_proj.weight", spec) == NOT_HELD
    assert expert_target("model.layers.0.mlp.experts.4.up_proj.weight", spec) == ("model.layers.0.mlp.w13", 1,
                                                                                  (64, 128))
    assert expert_target("model.layers.0.mlp.experts.3.down_proj.weight", spec) == ("model.layers.0.mlp.w2", 0, None)
    sharded = local_config(QWEN2_MOE, rank_share(QWEN2_MOE, 1, 2)).moe
    assert expert_target("model.layers.0.mlp.experts.1.up_proj.weight", sharded) == ("model.layers.0.mlp.w13", 1,
                                                                                     (32, 64))
