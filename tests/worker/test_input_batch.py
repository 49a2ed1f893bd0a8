"""The persistent batch applies plan deltas: add, append blocks, finish, preempt, resume."""

from __future__ import annotations

import pytest

from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import CachedRequestData, NewRequestData, StepPlan
from steploop.gpu_worker.input_batch import InputBatch


def new(handle, prompt, blocks, computed=0, output=()):
    return NewRequestData(handle, list(prompt), list(output), SamplingParams(), list(blocks), computed)


def test_add_append_finish_preempt_resume():
    batch = InputBatch()
    batch.apply_plan(StepPlan(0, new_requests=[new(1, range(20), [3, 4]), new(2, range(5), [5], computed=2)]))
    assert batch[1].num_tokens == 20 and batch[2].num_computed_tokens == 2
    batch[1].append_sampled([77], 20)
    cached = CachedRequestData()
    cached.append(1, 21, [6])
    cached.append(2, 5, [])
    batch.apply_plan(StepPlan(1, cached=cached))
    assert batch[1].block_ids == [3, 4, 6] and batch[1].token_ids[-1] == 77 and batch[1].num_output_tokens == 1
    assert batch[2].num_computed_tokens == 5
    # preempted 1 and finished 2; 1 resumes as new (prompt + outputs) and 2's handle is reused, in one plan
    batch.apply_plan(StepPlan(2, finished_handles=[2], preempted_handles=[1]))
    assert len(batch) == 0
    batch.apply_plan(StepPlan(3, new_requests=[new(1, range(20), [8, 9], output=[77]), new(2, [1], [2])]))
    assert batch[1].token_ids[-1] == 77 and batch[1].num_prompt_tokens == 20 and batch[1].num_computed_tokens == 0
    batch.reset()
    assert 1 not in batch


def test_bad_deltas_raise():
    batch = InputBatch()
    batch.apply_plan(StepPlan(0, new_requests=[new(1, range(4), [1])]))
    with pytest.raises(ValueError, match="reuses handle 1"):
        batch.apply_plan(StepPlan(1, new_requests=[new(1, range(4), [1])]))
    cached = CachedRequestData()
    cached.append(7, 1, [])
    with pytest.raises(KeyError, match="handle 7"):
        batch.apply_plan(StepPlan(2, cached=cached))
    cached = CachedRequestData()
    cached.append(1, 9, [])
    with pytest.raises(ValueError, match="knows only 4"):
        batch.apply_plan(StepPlan(3, cached=cached))
    assert len(batch.buffer("x", 1000)) == 1000


def test_stage_tokens_appended_before_the_last_stage_and_checked_on_it():
    plan = StepPlan(1, scheduled_handles=[1], num_scheduled_tokens=[1], stage_token_handles=[1], stage_token_ids=[77])
    early, last = InputBatch(), InputBatch()
    for batch in (early, last):
        batch.apply_plan(StepPlan(0, new_requests=[new(1, range(4), [1])]))
    last[1].append_sampled([77], 4)              # the last stage sampled it; the first has only the prompt
    early.take_stage_tokens(plan, verify=False)
    last.take_stage_tokens(plan, verify=True)
    assert early[1].token_ids == last[1].token_ids == [0, 1, 2, 3, 77]
    wrong = StepPlan(2, stage_token_handles=[1], stage_token_ids=[78])
    with pytest.raises(ValueError, match=r"stage tokens \[78\] are not the last stage's \[77\]"):
        last.take_stage_tokens(wrong, verify=True)
