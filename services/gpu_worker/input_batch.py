"""The persistent batch: what the worker remembers about each request between steps, updated from plan deltas.

Plans are deltas (see services/common/step_contract.py). Per plan, in this order:
  1. drop finished_handles and preempted_handles (a handle may be reused by a new request in the same plan);
  2. add every NewRequestData in full (prompt + outputs so far, block table, num_computed_tokens);
  3. for each CachedRequestData entry, take num_computed_tokens from the plan (the scheduler is authoritative)
     and append its new block ids.
The worker appends its own sampled tokens (the scheduler does not send them back), so `token_ids` may run
ahead of what the scheduler has seen: that is what lets it feed step N's token into step N+1.
The block tables also live in a PersistentBlockTable (block_table.py): one row per live request, on the device,
changed only by these deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from steploop.common.pooling_params import PoolingParams
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import NewRequestData, StepPlan
from steploop.gpu_worker.block_table import PersistentBlockTable


@dataclass
class RequestState:
    handle: int
    token_ids: list[int]          # [num_tokens] prompt + outputs known to the worker
    num_prompt_tokens: int
    block_ids: list[int]          # [num_blocks] the block table, in order
    num_computed_tokens: int      # tokens whose KV is in the cache
    sampling: SamplingParams
    pooling: PoolingParams | None = None   # an embedding request (pooling runner): pooled, never sampled
    pooled_sum: Any = None        # MEAN pooling: [hidden] fp32 sum of its hidden states over the chunks so far

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append_sampled(self, tokens: list[int], num_computed_tokens: int) -> None:
        """Record tokens this worker sampled, and how many tokens now have KV."""
        self.token_ids.extend(tokens)
        self.num_computed_tokens = num_computed_tokens


class InputBatch:
    """handle -> RequestState, the device block tables, plus reusable host buffers for building a step's inputs."""

    def __init__(self, device: str | object = "cpu", max_blocks_per_request: int = 64) -> None:
        self.requests: dict[int, RequestState] = {}
        self.table = PersistentBlockTable(device, width=max(max_blocks_per_request, 1))
        self._buffers: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, handle: int) -> bool:
        return handle in self.requests

    def __getitem__(self, handle: int) -> RequestState:
        state = self.requests.get(handle)
        if state is None:
            raise KeyError(f"the plan names handle {handle}, which this worker does not hold")
        return state

    def reset(self) -> None:
        """Forget everything (the stream broke: the scheduler preempts all the worker held)."""
        self.requests.clear()
        self.table.clear()

    def apply_plan(self, plan: StepPlan) -> None:
        for handle in (*plan.finished_handles, *plan.preempted_handles):
            self.requests.pop(handle, None)
            self.table.remove(handle)
        for new in plan.new_requests:
            self.add(new)
        cached = plan.cached
        for handle, num_computed, new_blocks in zip(cached.handles, cached.num_computed_tokens,
                                                    cached.new_block_ids):
            state = self[handle]
            if num_computed > state.num_tokens:
                raise ValueError(f"handle {handle}: plan says {num_computed} computed tokens, "
                                 f"the worker knows only {state.num_tokens}")
            state.num_computed_tokens = num_computed
            if new_blocks:
                state.block_ids.extend(new_blocks)
                self.table.append(handle, new_blocks)

    def add(self, new: NewRequestData) -> None:
        if new.handle in self.requests:
            raise ValueError(f"new request reuses handle {new.handle}, which is still live on this worker")
        if new.num_computed_tokens >= len(new.prompt_token_ids) + len(new.output_token_ids):
            raise ValueError(f"handle {new.handle}: num_computed_tokens {new.num_computed_tokens} leaves no token "
                             f"to compute")
        self.requests[new.handle] = RequestState(
            handle=new.handle, token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids), block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens, sampling=new.sampling, pooling=new.pooling)
        self.table.add(new.handle, list(new.block_ids))

    def take_stage_tokens(self, plan: StepPlan, verify: bool) -> None:
        """-pp: the tokens the last stage sampled since the plan before (StepPlan.stage_token_*). A stage before
        the last appends them; the last stage (verify) already has them and checks they are the same."""
        if verify:
            expected: dict[int, list[int]] = {}
            for handle, token in zip(plan.stage_token_handles, plan.stage_token_ids):
                expected.setdefault(handle, []).append(token)
            for handle, tokens in expected.items():
                if self[handle].token_ids[-len(tokens):] != tokens:
                    raise ValueError(f"handle {handle}: the plan's stage tokens {tokens} are not the last stage's "
                                     f"{self[handle].token_ids[-len(tokens):]}")
            return
        for handle, token in zip(plan.stage_token_handles, plan.stage_token_ids):
            self[handle].token_ids.append(token)

    def buffer(self, name: str, size: int, dtype: type = np.int64) -> np.ndarray:
        """A reusable host array of at least `size` elements (grows by doubling), sliced to `size`."""
        buf = self._buffers.get(name)
        if buf is None or len(buf) < size or buf.dtype != dtype:
            buf = np.empty(max(size, 2 * len(buf) if buf is not None else 256), dtype=dtype)
            self._buffers[name] = buf
        return buf[:size]
