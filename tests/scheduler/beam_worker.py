"""A fake worker for beam search tests whose "KV cache" is paged like the real one: each pool block holds, per
slot, the token id whose KV it stands for. A step writes the scheduled tokens into the request's blocks, then
reads the whole sequence back from its blocks (no other copy) and runs a tiny transformers Llama on it: a fork
that shares the wrong block, a copy on write that was not done or done late, or a block reused while still
needed all change the logits, so the beams stop matching transformers' generate(num_beams=...)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from steploop.common.step_contract import StepPlan, StepResult, TokenLogprob

EMPTY = -1


@dataclass
class _Held:
    tokens: list[int]           # prompt + outputs the worker knows (its own sampled token appended)
    block_ids: list[int]
    num_computed: int
    logprobs: int


@dataclass
class PagedFakeWorker:
    model: torch.nn.Module
    num_blocks: int
    block_size: int
    held: dict[int, _Held] = field(default_factory=dict)
    kv: list[list[int]] = field(default_factory=list)   # [num_blocks][block_size] token id per slot
    num_copies: int = 0

    def __post_init__(self) -> None:
        self.kv = [[EMPTY] * self.block_size for _ in range(self.num_blocks)]

    def execute(self, plan: StepPlan) -> StepResult:
        for handle in plan.finished_handles + plan.preempted_handles:
            self.held.pop(handle, None)
        for new in plan.new_requests:
            assert new.handle not in self.held, f"handle {new.handle} sent as new while held"
            self.held[new.handle] = _Held(new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                                          new.num_computed_tokens, new.sampling.logprobs)
        for handle, computed, blocks in zip(plan.cached.handles, plan.cached.num_computed_tokens,
                                            plan.cached.new_block_ids):
            held = self.held[handle]
            assert held.num_computed == computed, (handle, held.num_computed, computed)
            held.block_ids += blocks
        for src, dst in plan.block_copies:         # before the forward, as the real worker does
            self.kv[dst] = list(self.kv[src])
            self.num_copies += 1
        sampled, logprobs = {}, {}
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            held = self.held[handle]
            end = held.num_computed + n
            assert end <= len(held.tokens)
            for pos in range(held.num_computed, end):
                self.kv[held.block_ids[pos // self.block_size]][pos % self.block_size] = held.tokens[pos]
            held.num_computed = end
            if end < len(held.tokens):
                continue
            seq = [self.kv[held.block_ids[p // self.block_size]][p % self.block_size] for p in range(end)]
            with torch.no_grad():
                logits = self.model(torch.tensor([seq])).logits[0, -1].float()
            values, ids = logits.log_softmax(-1).topk(max(held.logprobs, 1))
            token = int(ids[0])
            held.tokens.append(token)
            sampled[handle] = [token]
            logprobs[handle] = [TokenLogprob(float(values[0]), ids.tolist(), values.tolist())]
        return StepResult(step_id=plan.step_id, sampled=sampled, logprobs=logprobs)
