"""What the scheduler and its step loop report, as plain data (as vLLM's SchedulerStats / IterationStats).

SchedulerStats: counters one Scheduler keeps while it runs. SchedulerCounters: monotonic counts since the
service started, summed over every scheduler built since (a worker with another pool rebuilds it). EngineLoad:
what the engine holds now, which Engine.GetLoadReport, the vllm:* gauges and the stats line read. StepStats: one
applied step, which the loop pushes to its observer. Observers see only these, never the loop or the pool.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field

from steploop.common.engine_contract import LoadReport
from steploop.scheduler.request import RequestOutput


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
    encoder_queries: int = 0          # images a chunk first reached (vision-language models)
    encoder_hits: int = 0             # of those, whose embeddings the encoder cache held
    images_encoded: int = 0           # images sent to the encoder

    def __add__(self, other: SchedulerCounters) -> SchedulerCounters:
        return SchedulerCounters(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class KvTierLoad:
    """One KV medium below the pool ("CPU" host memory, "DISK"): counters since start, blocks held now."""

    medium: str
    queries: int = 0                  # tokens looked up in it
    hits: int = 0                     # of those, tokens restored from it
    bytes_moved: int = 0              # bytes written to or read from it
    restore_seconds: float = 0.0      # worker time of the moves that restored blocks from it
    misses: int = 0                   # blocks that failed to read back (disk: absent/corrupt/foreign) or to write
    used_blocks: int = 0
    capacity_blocks: int = 0


@dataclass(frozen=True, slots=True)
class EngineLoad(LoadReport):
    """The engine now: the Engine seam's LoadReport (what GetLoadReport sends, its `to_pb`; num_waiting counts
    requests that arrived before any worker attached, num_total_blocks the null block) and what stays in the
    service."""

    counters: SchedulerCounters = field(default_factory=SchedulerCounters)   # since start
    step_cost: tuple[float, float] | None = None   # prefill pacing's learned step time: (base s, s per token)
    workers_attached: int = 0
    max_loras: int = 0                             # --max-loras with --enable-lora; 0 = LoRA off
    paused: bool = False                           # POST /pause (engine_control.py)
    weight_updates: int = 0                        # weight updates applied since start
    weight_version: str = "0"                      # the served weights' version (steploop:weight_version_info)
    kv_tiers: tuple[KvTierLoad, ...] = ()          # KV media below the pool; () = none
    pd: object = None                              # pd_disagg.PdStats: prefill/decode transfers; None = none
    kv_pull: object = None                         # kv_pull_import.KvPullStats: cross-replica pulls; None = none
    encoder_cache: tuple[int, int, int] = (0, 0, 0)  # (entries, embeddings held, capacity) of the encoder cache


@dataclass
class StepStats:
    """One step whose result was applied."""

    step_id: int
    num_scheduled_tokens: int         # tokens the step computed, drafts included
    forward_seconds: float            # forward + sampling, as the worker measured it
    plan_bytes: int                   # the serialized StepPlan's size on the plan stream
    outputs: list[RequestOutput]      # one per request that sampled (or finished) in it
