"""What the scheduler and its step loop report, as plain data (as vLLM's SchedulerStats / IterationStats).

SchedulerStats: counters one Scheduler keeps while it runs. SchedulerCounters: monotonic counts since the
service started, summed over every scheduler built since (a worker with another pool rebuilds it). LoadReport:
what the engine holds now, which Engine.GetLoadReport, the vllm:* gauges and the stats line read. StepStats: one
applied step, which the loop pushes to its observer. Observers see only these, never the loop or the pool.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field

from services.scheduler.request import RequestOutput


@dataclass
class SchedulerStats:
    num_preemptions: int = 0          # vllm:num_preemptions
    num_spec_steps: int = 0           # request-steps that verified at least one draft
    num_draft_tokens: int = 0         # vllm:spec_decode_num_draft_tokens (drafts the worker verified)
    num_accepted_tokens: int = 0      # vllm:spec_decode_num_accepted_tokens

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class SchedulerCounters:
    """Monotonic counts (the vllm:* / steploop:* counters), in tokens where the name says so."""

    preemptions: int = 0
    prefix_queries: int = 0           # tokens looked up in the prefix cache
    prefix_hits: int = 0              # of those, tokens found
    spec_drafts: int = 0              # request-steps that verified drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    paced_steps: int = 0              # steps in which prefill pacing cut a prompt chunk
    deferred_prompt_tokens: int = 0   # prompt tokens pacing held back, summed over steps

    def __add__(self, other: SchedulerCounters) -> SchedulerCounters:
        return SchedulerCounters(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class LoadReport:
    """The engine now. The first six fields are steploop.v1.LoadReport's; the rest stay in the service."""

    num_running: int = 0
    num_waiting: int = 0              # in the scheduler's queue, or arrived before any worker attached
    num_free_blocks: int = 0
    num_total_blocks: int = 0         # as the worker reported, the null block included (0: no worker yet)
    kv_cache_usage: float = 0.0       # 0..1 of the usable blocks
    num_steps: int = 0                # steps applied since start
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)   # since start
    step_cost: tuple[float, float] | None = None   # prefill pacing's learned step time: (base s, s per token)
    workers_attached: int = 0
    running_lora_adapters: tuple[str, ...] = ()    # distinct adapters of running requests (vllm:lora_requests_info)
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0                             # --max-loras with --enable-lora; 0 = LoRA off


@dataclass
class StepStats:
    """One step whose result was applied."""

    step_id: int
    num_scheduled_tokens: int         # tokens the step computed, drafts included
    forward_seconds: float            # forward + sampling, as the worker measured it
    plan_bytes: int                   # the serialized StepPlan's size on the plan stream
    outputs: list[RequestOutput]      # one per request that sampled (or finished) in it
