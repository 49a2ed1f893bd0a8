"""Pipeline parallelism's plumbing without a forward: how layers split into stages, which checkpoint tensors a
stage reads, the configurations refused with -pp, and the scheduler's side (world = tp x pp, the last stage's
answer carries the tokens, a rank started with another -pp refused naming both)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from steploop.common.errors import InvalidRequestError
from steploop.common.step_contract import StepPlan, StepResult, WorkerInfo
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.distributed.pipeline import PipelineShapeError, StageShare, stage_layers
from steploop.scheduler.worker_group import GroupAssembler
from steploop.scheduler.worker_link import WorkerLink
from tests.tp.test_worker_group import FakeStream, info


def test_layers_split_contiguously_the_first_stages_taking_the_remainder():
    assert stage_layers(5, 2) == [(0, 3), (3, 5)]
    assert stage_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_layers(2, 2) == [(0, 1), (1, 2)]
    with pytest.raises(PipelineShapeError, match="-pp 3: the model has 2 layers, fewer than the stages"):
        stage_layers(2, 3)


def test_a_stage_reads_only_its_own_tensors_renumbered():
    first, last = StageShare(0, 2, 0, 3), StageShare(1, 2, 3, 5)
    assert first.local_name("model.layers.2.mlp.down_proj.weight") == "model.layers.2.mlp.down_proj.weight"
    assert first.local_name("model.layers.3.mlp.down_proj.weight") is None
    assert last.local_name("model.layers.3.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert last.local_name("model.layers.12.self_attn.q_proj.weight") is None
    assert first.local_name("model.embed_tokens.weight") and last.local_name("model.embed_tokens.weight") is None
    assert first.local_name("lm_head.weight") is None and first.local_name("model.norm.weight") is None
    assert last.local_name("lm_head.weight") == "lm_head.weight" and last.local_name("model.norm.weight")
    tied_last = StageShare(1, 2, 3, 5, tie_word_embeddings=True)    # its head is the embedding
    assert tied_last.local_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert StageShare(1, 3, 2, 4, tie_word_embeddings=True).local_name("model.embed_tokens.weight") is None


@pytest.mark.parametrize("changes, message", [
    ({"lora": "on"}, "--enable-lora with -pp 2"),
    ({"runner": "pooling"}, "--runner pooling with -pp 2"),
    ({"kv_offloading_size": 1.0}, "--kv-offloading-size with -pp 2"),
    ({"rank": 4, "tensor_parallel_size": 2}, r"--rank 4 must be in 0..3 for -tp 2 -pp 2"),
])
def test_worker_refuses_what_stages_cannot_run(changes, message):
    if changes.pop("lora", None):
        from steploop.common.lora_config import LoraConfig
        changes["lora"] = LoraConfig(enable_lora=True)
    with pytest.raises(ValueError, match=message):
        WorkerConfig(pipeline_parallel_size=2, **changes)


def test_scheduler_refuses_speculative_drafts_with_stages():
    from steploop.scheduler.config import SchedulerConfig
    from steploop.scheduler.engine_loop import EngineLoop
    from steploop.scheduler.server_config import ServerConfig
    with pytest.raises(ValueError, match="--speculative-ngram with -pp 2"):
        EngineLoop(SchedulerConfig(num_speculative_tokens=3), ServerConfig(pipeline_parallel_size=2))


def test_group_of_tp_x_pp_ranks_answers_with_the_last_stage():
    async def scenario():
        assembler = GroupAssembler(2, 30.0, pipeline_parallel_size=2)     # -tp 2 -pp 2: 4 ranks
        with pytest.raises(InvalidRequestError, match="started with -tp 4; this scheduler serves -tp 2 -pp 2"):
            assembler.add(WorkerLink(FakeStream(), info(0, world=4)))
        links = [WorkerLink(FakeStream(), info(r, world=4, pipeline_parallel_size=2)) for r in range(4)]
        assert WorkerInfo.from_pb(links[3].info.to_pb()).pipeline_parallel_size == 2     # the hello carries it
        group = None
        for link in links:
            group = assembler.add(link)
        assert group is not None and group.answer_rank == 2               # stage 1's tp rank 0
        plan = StepPlan(step_id=3)
        await group.send(plan)
        for r, link in enumerate(links):
            link._results.put_nowait(StepResult(step_id=3, sampled={5: [9]} if r == 2 else {}).to_pb())
        assert (await group.recv(plan)).sampled == {5: [9]}
    asyncio.run(scenario())


def test_serve_starts_tp_x_pp_ranks_and_refuses_more_stages_than_layers(model_dir):
    from steploop.serve import check_tensor_parallel, worker_specs
    args = argparse.Namespace(model=str(model_dir), tensor_parallel_size=1, pipeline_parallel_size=2,
                              enable_expert_parallel=False, worker_metrics_port=0, num_threads=1)
    check_tensor_parallel(args)
    assert [s.name for s in worker_specs(args, {})] == ["worker", "worker-1"]
    args.pipeline_parallel_size = 64
    with pytest.raises(PipelineShapeError, match="-pp 64: the model has 30 layers"):
        check_tensor_parallel(args)
