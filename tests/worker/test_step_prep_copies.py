"""How many host-to-device copies and host-device synchronizations one decode step's preparation makes, counted on
the CPU by watching the calls that become one on a GPU: `.to(<device>)`, `torch.tensor(..., device=)` /
`as_tensor(device=)` (a copy each from unpinned memory), `copy_` (into a static or device buffer) and `.item()` /
`.tolist()` / `.cpu()` / `.numpy()` / `nonzero` (each waits for the GPU).

The preparation is what runs before the forward and after it until sampling: the step inputs and attention
metadata (step_inputs.py, attention/metadata.py), the triton backend's per-step plan (the GPU path's), and the
sampling metadata (sampler.py): ModelRunner.prepare_step, with the triton backend's plan. Issue 39 sets the goal
at <= 2; on 2026-12-02 it was 15 (9 `.to(device)` + 6 `torch.tensor(device=)`). Now every array is packed into one
staging buffer and sent with one copy (staging.py), and the block tables are updated on the device by the plan's
diffs (block_table.py): 1 copy, 0 syncs. The sampled tokens' one transfer back (SamplerOutput.to_host) is after
the forward, outside the preparation.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from tests.worker.driver import Driver

SYNCS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "synchronize"}
GOAL = 2


class CopySyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in SYNCS:
            self.counts[f"sync {name}"] += 1
        elif name == "to" and (kwargs.get("device") is not None or any(_is_device(a) for a in args[1:])):
            self.counts["copy .to(device)"] += 1
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.counts[f"copy torch.{name}(device=)"] += 1
        elif name == "copy_":
            self.counts["copy copy_"] += 1
        return func(*args, **kwargs)


def _is_device(a) -> bool:
    return isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda"))


def _decode_plan(runner, driver: Driver):
    from steploop.common.step_contract import StepPlan

    plan = StepPlan(step_id=driver.step_id)
    for req in driver.requests.values():                    # the next step: one decode token per request
        plan.cached.append(req.handle, req.num_computed, driver._grow(req, req.num_computed + 1))
        plan.scheduled_handles.append(req.handle)
        plan.num_scheduled_tokens.append(1)
    return plan


def count_decode_prep(runner, sampling=None) -> tuple[Counter, object]:
    """Run prompts to their first token, then count one 4-request decode step's preparation."""
    from steploop.gpu_worker.attention.triton_backend import TritonAttentionBackend
    from steploop.gpu_worker.staging import StagingBuffer

    driver = Driver(runner)
    for i in range(4):
        driver.add(i, [5 + i, 17, 300 + i, 42, 7] * (i + 1), 8, sampling)
    driver.step(64)                                         # prompts in; one token each
    plan = _decode_plan(runner, driver)
    runner.batch.apply_plan(plan)
    runner.staging = StagingBuffer(runner.device, direct=False)   # the GPU's route (the CPU's default copies nothing)
    cfg = runner.model.config
    triton = TritonAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.scale)
    with CopySyncCounter() as counter:
        step = runner.prepare_step(plan, triton)
        md = step.attn_metadata(triton)
    return counter.counts, (step, md)


def test_decode_step_preparation_copies_and_syncs(fresh_runner):
    counts, _ = count_decode_prep(fresh_runner)
    total = sum(counts.values())
    print(f"decode step preparation: {total} host-device copies/syncs: {dict(counts)}")
    assert counts["copy copy_"] == 1               # the counter sees the step's one copy
    assert not any(k.startswith("sync") for k in counts), dict(counts)
    assert total <= GOAL, dict(counts)


def test_sampling_with_logprobs_and_top_k_adds_no_copy(fresh_runner):
    from steploop.common.sampling_params import SamplingParams

    counts, (step, _) = count_decode_prep(fresh_runner, SamplingParams(temperature=0.7, top_k=5, logprobs=2))
    assert sum(counts.values()) <= GOAL and counts["copy copy_"] == 1, dict(counts)
    assert step.sampling.use_top_k and not step.sampling.all_greedy
    assert step.sampling.top_k.tolist() == [5] * 4


def test_the_cpu_route_copies_nothing(fresh_runner):
    from steploop.gpu_worker.staging import StagingBuffer

    driver = Driver(fresh_runner)
    driver.add(0, [5, 17, 300, 42, 7], 8)
    driver.step(64)
    plan = _decode_plan(fresh_runner, driver)
    fresh_runner.batch.apply_plan(plan)
    fresh_runner.staging = StagingBuffer(fresh_runner.device)
    with CopySyncCounter() as counter:
        step = fresh_runner.prepare_step(plan)
    assert not counter.counts, dict(counter.counts)
    assert step.inputs.input_ids.tolist() == [driver.requests[0].tokens[-1]]


def test_staged_inputs_match_a_rebuild_from_the_request_lists(fresh_runner):
    """The device views equal what the old path built from Python lists (block tables padded with 0)."""
    import numpy as np

    _, (step, md) = count_decode_prep(fresh_runner)
    batch, attn = fresh_runner.batch, step.inputs.attn
    states = [batch[h] for h in sorted(batch.requests)]
    width = max(len(s.block_ids) for s in states)
    want = np.zeros((len(states), width), np.int32)
    for i, s in enumerate(states):
        want[i, :len(s.block_ids)] = s.block_ids
    assert attn.block_tables.numpy().tolist() == want.tolist()
    assert attn.seq_lens.tolist() == [s.num_computed_tokens + 1 for s in states]
    assert step.inputs.input_ids.tolist() == [s.token_ids[s.num_computed_tokens] for s in states]
    bs = fresh_runner.block_size
    assert attn.slot_mapping.tolist() == [s.block_ids[p // bs] * bs + p % bs
                                          for s in states for p in [s.num_computed_tokens]]
    assert md.plan.tile_req.tolist() == [0, 1, 2, 3] and attn.query_start_loc.tolist() == [0, 1, 2, 3, 4]
