"""The worker's copy on write of KV blocks (kv_block_copy.py): a plan's block copies on a CPU paged cache; and beam
search end to end in process, the real Scheduler's beam groups driving the real ModelRunner (default model, fp32
CPU): forked beams read their parent's blocks and their own copy of its partial last block, and the beams equal
transformers' generate(num_beams=W) for 4 prompts x beams 2 and 4."""

from __future__ import annotations

import pytest
import torch

from steploop.common.beam_ranking import BeamConfig
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan
from steploop.gpu_worker import kv_block_copy
from steploop.gpu_worker.kv_cache import allocate_kv_caches
from steploop.scheduler.async_scheduler import make_scheduler
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request, RequestStatus


class _Cfg:
    num_key_value_heads, head_dim, num_hidden_layers = 2, 8, 3


def test_copy_blocks_on_a_paged_cache():
    caches = allocate_kv_caches(_Cfg, 10, 4, torch.float32, torch.device("cpu"))
    for cache in caches:
        cache.copy_(torch.randn_like(cache))
    before = [c.clone() for c in caches]
    kv_block_copy.copy_blocks(caches, [(3, 7), (5, 2), (3, 9)])
    for cache, old in zip(caches, before):
        for src, dst in [(3, 7), (5, 2), (3, 9)]:
            assert torch.equal(cache[:, dst], old[:, src])     # K and V, every slot
        untouched = [b for b in range(10) if b not in (7, 2, 9)]
        assert torch.equal(cache[:, untouched], old[:, untouched])
    kv_block_copy.copy_blocks(caches, [])                      # a plan without copies: nothing to do


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The three primary colors are"]
MAX_NEW = 8


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4])
def test_beam_groups_on_the_real_worker_equal_transformers(fresh_runner, hf_model, model_dir, width):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    info = fresh_runner.info
    eos = hf_model.generation_config.eos_token_id
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, async_scheduling=True)
    kv = KVCacheManager(info.num_kv_blocks, fresh_runner.block_size, True)
    sched = make_scheduler(config, kv, info.max_model_len, list(info.eos_token_ids))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    for i, ids in enumerate(prompts):
        sched.add_request(Request(f"g{i}", ids, arrival_time=float(i), sampling=SamplingParams(max_tokens=MAX_NEW),
                                  beam=BeamConfig(width, 1.0, False)))
    outs, copies, pending = {}, 0, None
    while sched.has_unfinished_requests() or pending is not None:     # one plan in flight, as the engine loop
        plan = sched.schedule() if sched.has_unfinished_requests() else None
        if pending is not None:
            for out in sched.update_from_output(*pending):
                outs[out.request_id] = out
        if plan is not None:
            copies += len(plan.block_copies)
            result = fresh_runner.execute(plan)
            assert not result.error, result.error
        pending = (plan, result) if plan is not None else None
        sched.check_integrity()
    assert copies > 0, "no fork copied a partial block"
    assert kv.num_free_blocks == kv.num_usable_blocks
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), do_sample=False, num_beams=width, num_return_sequences=width,
                                    max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos,
                                    return_dict_in_generate=True, output_scores=True)
        out = outs[f"g{i}"]
        assert out.finish_reason == RequestStatus.FINISHED_STOPPED
        for h, row, indices, score in zip(out.beams, ref.sequences, ref.beam_indices, ref.sequences_scores):
            length = int((indices >= 0).sum())
            assert h.tokens == row[len(ids):len(ids) + length].tolist(), (PROMPTS[i], width)
            assert h.score == pytest.approx(score.item(), abs=1e-3)


def test_plan_carries_copies_over_the_wire():
    plan = StepPlan(step_id=4, block_copies=[(3, 7), (5, 2)])
    assert StepPlan.from_pb(plan.to_pb()).block_copies == [(3, 7), (5, 2)]
