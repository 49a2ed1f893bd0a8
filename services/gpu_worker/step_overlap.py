"""Step N+1 prepared and launched while step N runs on the GPU: the worker's half of async scheduling.

Under async scheduling the scheduler sends plan N+1 before it has step N's tokens (async_scheduler.py). A worker
that finished step N before it looked at plan N+1 would leave the GPU idle while it builds N+1's inputs (about 1 ms a
step on an H200 at batch 1: 18% of a Llama-3-8B decode step). So a step is split in two:

    launch(N):  apply the plan, stage and send the inputs, forward, sample, start the copy of the sampled tokens
                to pinned host memory; each token it sampled is a *placeholder* in its request's token_ids
    finish(N):  wait for that copy only, put the tokens in place of the placeholders, build StepResult N

and the runner keeps one launched step in flight: launch(N+1), then finish(N). A placeholder is -(1 + the row of
the token in step N's sampled tokens), so step N+1's inputs name where each of their tokens is on the device
(step_inputs.fill_holes copies them there, in stream order after step N's sampling). The host reads no token
value between launch(N) and finish(N) unless a request's sampling needs one:

    penalties, bad_words and grammars read a request's output tokens when its next row is sampled; a request
    whose drafts step N verifies has an unknown number of tokens until finish(N)

A plan with such a request among those step N sampled for is launched after finish(N) (`may_follow` says). So
are plans on a pipeline stage, pooling and vision-language runners, which never keep a step in flight. The results
are the same as finishing each step first: same inputs, same order on the one stream, same sampler state.
On the CPU a step's work is done when launch returns, so nothing overlaps and the runner finishes at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from steploop.common import envs
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import StepPlan, StepResult


def keeps_step_in_flight(device: torch.device, pipe, pooling, multimodal: bool) -> bool:
    """Whether the runner keeps a step in flight: on CUDA, for a generate runner of a text model that is not a
    pipeline stage, unless STEPLOOP_WORKER_OVERLAP=0."""
    return (device.type == "cuda" and pipe is None and pooling is None and not multimodal
            and envs.switched_off(envs.WORKER_OVERLAP) is None)


def placeholder(row: int) -> int:
    """The token id standing for row `row` of the in-flight step's sampled tokens (negative: never a real id)."""
    return -1 - row


def reads_outputs(sampling: SamplingParams) -> bool:
    """Whether sampling the request's next token reads its previous output tokens on the host."""
    return sampling.penalized or bool(sampling.bad_words) or sampling.structured


@dataclass
class LaunchedStep:
    """One step between launch and finish."""
    plan: StepPlan
    result: StepResult                   # done steps carry their whole result; else the sampled part is missing
    start: float = field(default_factory=time.perf_counter)
    launch_seconds: float = 0.0          # host time launch took
    sampling: list = field(default_factory=list)        # [SamplingSlot] the rows that sampled
    states: list = field(default_factory=list)          # [RequestState] per slot, as they were at launch
    tokens: torch.Tensor | None = None   # [S] the sampled tokens on the device (what placeholders point into)
    copy: object | None = None          # sampler.HostCopy under way
    timing: tuple | None = None          # CUDA: (start, end) events around the step's device work

    @property
    def done(self) -> bool:
        return self.copy is None

    @property
    def event(self):
        """What to wait on before finish() stops blocking (None: nothing)."""
        return self.copy.event if self.copy is not None else None

    def forward_seconds(self, waited: float) -> float:
        """The step's cost: its device time where the GPU timed it (host work overlaps it), else host time."""
        if self.timing is not None:
            start, end = self.timing
            return max(start.elapsed_time(end) / 1e3, self.launch_seconds)
        return self.launch_seconds + waited


def may_follow(pending: LaunchedStep, plan: StepPlan) -> bool:
    """Whether `plan` can be launched before `pending` is finished (module docstring: when it cannot)."""
    scheduled = set(plan.scheduled_handles)
    for slot, state in zip(pending.sampling, pending.states):
        if slot.handle in scheduled and (slot.drafts or reads_outputs(state.sampling)):
            return False
    return True
