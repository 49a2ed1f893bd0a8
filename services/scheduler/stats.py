"""Counters the scheduler keeps for metrics (monotonic since start; the server turns them into vllm:* series)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_preemptions: int = 0          # vllm:num_preemptions
    num_spec_steps: int = 0           # request-steps that verified at least one draft
    num_draft_tokens: int = 0         # vllm:spec_decode_num_draft_tokens (drafts the worker verified)
    num_accepted_tokens: int = 0      # vllm:spec_decode_num_accepted_tokens

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
