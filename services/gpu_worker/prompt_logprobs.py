"""Prompt logprobs (echo, loglikelihood scoring): the logprob of each prompt token given the tokens before it.

For a request that asks (sampling.prompt_logprobs = k >= 0) and whose chunk this step covers positions
c .. c + n - 1, the hidden states at positions c .. min(c + n, P - 1) - 1 predict prompt tokens c + 1 .. ;
those rows are appended to the forward's logits rows, and lm_head runs on them only (in slices, so a long
chunk never materializes [n, vocab] at once). The scheduler stitches the chunks together (it knows each c).

    forward rows:  [ sampling rows (S) | prompt rows of request a | prompt rows of request b | ... ]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from steploop.common.step_contract import StepPlan, TokenLogprob
from steploop.gpu_worker.input_batch import InputBatch

SLICE_ROWS = 256   # lm_head rows per slice: bounds the [rows, vocab] fp32 logits to ~50 MB at vocab 49k


@dataclass
class PromptLogprobRows:
    rows: list[int] = field(default_factory=list)       # [R] flat token rows of the step's batch
    targets: list[int] = field(default_factory=list)    # [R] the prompt token each row predicts
    spans: list[tuple[int, int, int]] = field(default_factory=list)   # (handle, count, k) in row order

    def __bool__(self) -> bool:
        return bool(self.rows)

    def logits_indices(self, sampling_rows: torch.Tensor) -> torch.Tensor:
        extra = torch.tensor(self.rows, dtype=torch.int64, device=sampling_rows.device)
        return torch.cat([sampling_rows, extra])

    def compute(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
                ) -> dict[int, list[TokenLogprob]]:
        """hidden [R, hidden] of self.rows -> handle -> [count] TokenLogprob (with its rank, and the top k when
        k > 0)."""
        max_k = max(k for _, _, k in self.spans)
        targets = torch.tensor(self.targets, dtype=torch.int64, device=hidden.device)
        own, ranks, top_lp, top_ids = [], [], [], []
        for start in range(0, len(self.rows), SLICE_ROWS):
            logprobs = compute_logits(hidden[start:start + SLICE_ROWS]).log_softmax(dim=-1)
            mine = logprobs.gather(1, targets[start:start + SLICE_ROWS].unsqueeze(1))        # [rows, 1]
            own.append(mine.squeeze(1))
            ranks.append((logprobs > mine).sum(dim=1) + 1)        # vLLM's rank: 1 + strictly more likely tokens
            if max_k > 0:
                lp, ids = logprobs.topk(max_k, dim=-1)
                top_lp.append(lp)
                top_ids.append(ids)
        own_list, rank_list = torch.cat(own).tolist(), torch.cat(ranks).tolist()
        top_lp_list = torch.cat(top_lp).tolist() if max_k > 0 else None
        top_ids_list = torch.cat(top_ids).tolist() if max_k > 0 else None
        out, pos = {}, 0
        for handle, count, k in self.spans:
            out[handle] = [TokenLogprob(own_list[r], top_ids_list[r][:k] if k else [],
                                        top_lp_list[r][:k] if k else [], rank_list[r])
                           for r in range(pos, pos + count)]
            pos += count
        return out


def plan_prompt_logprob_rows(batch: InputBatch, plan: StepPlan) -> PromptLogprobRows:
    """Which rows need prompt logprobs this step. Call before the batch's counters advance for the step."""
    out = PromptLogprobRows()
    flat = 0
    for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
        state = batch[handle]
        k = state.sampling.prompt_logprobs
        c, last = state.num_computed_tokens, state.num_prompt_tokens - 1
        if k >= 0 and c < last:
            stop = min(c + n, last)
            out.rows.extend(range(flat, flat + stop - c))
            out.targets.extend(state.token_ids[c + 1:stop + 1])
            out.spans.append((handle, stop - c, k))
        flat += n
    return out
