"""How many host-to-device copies and host-device synchronizations one decode step's preparation makes, counted on
the CPU by watching the calls that become one on a GPU: `.to(<device>)`, `torch.tensor(..., device=)` /
`as_tensor(device=)` (a copy each from unpinned memory), `copy_` (into a static or device buffer) and `.item()` /
`.tolist()` / `.cpu()` / `.numpy()` / `nonzero` (each waits for the GPU).

The preparation is what runs before the forward and after it until sampling: the step inputs and attention
metadata (step_inputs.py, attention/metadata.py), the triton backend's per-step plan (the GPU path's), and the
sampling metadata (sampler.py). Issue 39 sets the goal at <= 2 (pinned buffers, one packed copy, block tables
updated by diffs on the device); until that lands this test pins today's count so it can only go down.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from tests.worker.driver import Driver

SYNCS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "synchronize"}
TODAY = 15        # measured 2026-12-02, 4-request decode: 9 `.to(device)` + 6 `torch.tensor(device=)`; goal: 2


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


def count_decode_prep(runner) -> Counter:
    """Run prompts to their first token, then count one 4-request decode step's preparation."""
    from steploop.common.step_contract import StepPlan
    from steploop.gpu_worker.attention.triton_backend import TritonAttentionBackend
    from steploop.gpu_worker.step_inputs import prepare_step_inputs

    driver = Driver(runner)
    for i in range(4):
        driver.add(i, [5 + i, 17, 300 + i, 42, 7] * (i + 1), 8)
    driver.step(64)                                         # prompts in; one token each
    plan = StepPlan(step_id=driver.step_id)
    for req in driver.requests.values():                    # the next step: one decode token per request
        plan.cached.append(req.handle, req.num_computed, driver._grow(req, req.num_computed + 1))
        plan.scheduled_handles.append(req.handle)
        plan.num_scheduled_tokens.append(1)
    runner.batch.apply_plan(plan)
    cfg = runner.model.config
    triton = TritonAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.scale)
    with CopySyncCounter() as counter:
        inputs = prepare_step_inputs(runner.batch, plan, runner.block_size, runner.max_model_len, runner.device)
        triton.build_metadata(inputs.attn)
        runner._sampling_metadata(inputs)
    return counter.counts


def test_decode_step_preparation_copies_and_syncs(fresh_runner):
    counts = count_decode_prep(fresh_runner)
    total = sum(counts.values())
    print(f"decode step preparation: {total} host-device copies/syncs: {dict(counts)}")
    assert counts["copy .to(device)"] > 0          # the counter sees the step's copies at all
    assert total <= TODAY, dict(counts)
