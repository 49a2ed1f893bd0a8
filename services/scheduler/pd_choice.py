"""Where a prompt runs, per request at admission: on the prefill group (disaggregated) or on the decode group (local).

Forced by the request's `disaggregation` field; local whenever a group cannot take part (the prefill group is down,
the decode worker has no receiver) or the request needs what the prefill side lacks (an adapter, where the prefill
workers run without --enable-lora). Otherwise, with --disagg-policy cost (the default), the step-cost models of
both groups (step_cost.py, learned from their own steps) price the two ways as seconds of delay summed over everyone
they delay:

  local = ttft_local + streams * prompt_local
      prompt_local  = b*T + c*pairs(T)            T: prompt tokens not cached on the decode group (pool or host)
      ttft_local    = queue_local + prompt_local + steps * decode_step
      steps         = chunks the prompt takes: max(T / token budget, prompt_local / pacing allowance)
      streams       = requests running or waiting on the decode group: each one's next tokens wait for the chunks
  disaggregated = ttft_remote + streams * blocks * load_per_block
      ttft_remote   = queue_prefill + prompt_prefill(T') + blocks * block_bytes / bandwidth + overhead
      queue_*       = the group's prompt tokens already waiting or running there, priced by its model
      bandwidth     = measured from confirmed transfers (LinkRate), a prior until then
      overhead      = HANDOFF_SECONDS + 2 decode steps (the plan that receives, then the one that loads)

and the cheaper one wins (a tie stays local). A prompt whose uncached part is at most one block runs locally with
nothing to move ("cached": a mostly cached prompt never crosses the link). While neither group's model has timings
(one group's model stands in for the other's), a prompt whose uncached part is --disagg-min-prompt-tokens or more
goes disaggregated ("threshold"). With
--disagg-policy length the threshold on the whole prompt decides always (0: every prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from steploop.scheduler.step_cost import attention_pairs

if TYPE_CHECKING:
    from steploop.scheduler.pd_disagg import PdDisagg
    from steploop.scheduler.request import Request

HANDOFF_SECONDS = 0.005           # a prefill plan's round trip and the receiver's answer, beyond the decode steps
PRIOR_BYTES_PER_SECOND = 1e9      # a 10 GbE-class link, until a confirmed transfer was timed

Coef = tuple[float, float, float]   # StepCostModel.coefficients(): (a s, b s/token, c s/pair)


@dataclass(frozen=True)
class Choice:
    disaggregate: bool
    reason: str                   # forced | down | unsupported | short | cached | cost | threshold | length
    local_seconds: float = -1.0   # the two estimates (reason "cost" only; -1: not estimated)
    remote_seconds: float = -1.0

    @property
    def label(self) -> str:
        return "disaggregated" if self.disaggregate else "local"


class LinkRate:
    """Prefill-to-decode bandwidth: an exponentially weighted mean of seconds per byte over confirmed transfers
    (time per byte, not bytes per second: predictions are times), starting from a prior."""

    def __init__(self, prior_bytes_per_second: float = PRIOR_BYTES_PER_SECOND, weight: float = 0.3) -> None:
        self.seconds_per_byte = 1.0 / prior_bytes_per_second
        self.weight = weight
        self.num_observations = 0

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or not seconds > 0.0:
            return
        self.seconds_per_byte += self.weight * (seconds / num_bytes - self.seconds_per_byte)
        self.num_observations += 1

    @property
    def bytes_per_second(self) -> float:
        return 1.0 / self.seconds_per_byte


@dataclass
class Load:
    """What the estimate reads, taken at admission (snapshot())."""
    prompt_tokens: int
    block_size: int
    block_bytes: int              # one block over all layers
    budget: int                   # token budget of a step (the largest chunk)
    local_hit: int                # prompt tokens cached on the decode group (pool, then host tier)
    remote_hit: int               # ... on the prefill group's pool
    streams: int                  # requests running or waiting on the decode group
    decode_context: int           # context tokens of the running ones (a decode step's attention)
    queue_local: float            # seconds of prompt work already queued on the decode group
    queue_remote: float           # ... on the prefill group
    pacing_ratio: float           # --max-decode-slowdown (0: off)
    load_per_block: float         # host tier to pool, seconds per block (0: not measured)


def prompt_seconds(coef: Coef, tokens: int, start: int) -> float:
    """Matmul and attention time of `tokens` prompt tokens from position `start` (no step base)."""
    _, b, c = coef
    return b * tokens + c * attention_pairs(tokens, start + tokens) if tokens > 0 else 0.0


def estimate(load: Load, local: Coef, remote: Coef, link: LinkRate) -> tuple[float, float]:
    """(local, disaggregated) cost in seconds of delay, summed over the request and the streams it slows."""
    a, b, c = local
    decode_step = a + b * load.streams + c * load.decode_context
    tokens = load.prompt_tokens - load.local_hit
    work = prompt_seconds(local, tokens, load.local_hit)
    steps = math.ceil(tokens / load.budget)
    if load.streams and load.pacing_ratio > 1.0 and decode_step > 0.0:   # the pacer stretches it over more steps
        steps = max(steps, math.ceil(work / ((load.pacing_ratio - 1.0) * decode_step)))
    local_cost = load.queue_local + work + steps * decode_step + load.streams * work
    remote_tokens = load.prompt_tokens - load.remote_hit
    blocks = (load.prompt_tokens - 1) // load.block_size          # every full block is sent (pd_disagg._add_sends)
    remote_ttft = (load.queue_remote + math.ceil(remote_tokens / load.budget) * remote[0]
                   + prompt_seconds(remote, remote_tokens, load.remote_hit)
                   + blocks * load.block_bytes * link.seconds_per_byte + HANDOFF_SECONDS + 2 * decode_step)
    return local_cost, remote_ttft + load.streams * blocks * load.load_per_block


def queued_seconds(coef: Coef, requests, budget: int) -> float:
    """Prompt work still to run for `requests` (each one's remaining prompt tokens, in chunks of `budget`)."""
    total = 0.0
    for r in requests:
        left = r.num_prompt_tokens - r.num_computed_tokens
        if left > 0:
            total += math.ceil(left / budget) * coef[0] + prompt_seconds(coef, left, r.num_computed_tokens)
    return total


def local_hit_tokens(kv, request: Request) -> int:
    """Prompt tokens the decode group holds: its pool's prefix hit, continued by loadable host-tier blocks."""
    _, hit = kv.get_computed_blocks(request)
    if kv.tiers is None:
        return hit
    host, i, end = kv.tiers.host, hit // kv.block_size, (request.num_tokens - 1) // kv.block_size
    hashes = request.block_hashes
    while i < end and i < len(hashes) and hashes[i] in host.entries and hashes[i] not in host.pending:
        i += 1
    return i * kv.block_size


def snapshot(pd: PdDisagg, request: Request, local: Coef, remote: Coef) -> Load:
    engine, sched, prefill = pd.engine, pd.engine.scheduler, pd.scheduler
    budget = max(sched.config.max_num_batched_tokens, 1)
    context = sum(r.num_tokens for r in sched.running)
    queue_local = queued_seconds(local, [*sched.running, *sched.waiting], budget)
    queue_remote = queued_seconds(remote, [j.prefill for j in pd.jobs.values() if not j.sent], budget)
    _, remote_hit = prefill.kv.get_computed_blocks(request)
    tiers = sched.kv.tiers
    return Load(prompt_tokens=request.num_prompt_tokens, block_size=sched.kv.block_size,
                block_bytes=engine.worker_info.transfer_block_bytes, budget=budget,
                local_hit=local_hit_tokens(sched.kv, request), remote_hit=remote_hit,
                streams=len(sched.running) + len(sched.waiting), decode_context=context,
                queue_local=queue_local, queue_remote=queue_remote,
                pacing_ratio=sched.pacer.ratio if sched.pacer is not None else 0.0,
                load_per_block=tiers.seconds_per_block if tiers is not None else 0.0)


class PdChooser:
    def __init__(self, pd: PdDisagg, policy: str, min_prompt_tokens: int) -> None:
        self.pd, self.policy, self.min_prompt_tokens = pd, policy, min_prompt_tokens
        self.link = LinkRate()

    def choose(self, request: Request, mode: str) -> Choice:
        pd = self.pd
        engine, decode = pd.engine, pd.engine.worker_info
        if mode == "local":
            return Choice(False, "forced")
        if not pd.up or decode is None or not decode.kv_transfer_address:
            return Choice(False, "down")
        sched = engine.scheduler
        if (sched is None or sched.kv.tiers is None or not sched.kv.enable_prefix_caching
                or engine.control.weight_updates          # the prefill worker still holds the weights it started with
                or (request.lora_name and not pd.serves_lora)      # its prefill workers load no adapters
                or request.pooling is not None or request.sampling.prompt_logprobs >= 0
                or request.output_token_ids):             # pooling, prompt logprobs, a resumed request
            return Choice(False, "unsupported")
        if request.num_prompt_tokens <= decode.block_size:
            return Choice(False, "short")                 # not one full block to move
        if mode == "disaggregated":
            return Choice(True, "forced")
        if self.policy == "length":
            return Choice(request.num_prompt_tokens >= self.min_prompt_tokens, "length")
        return self._by_cost(request)

    def _by_cost(self, request: Request) -> Choice:
        pd, sched = self.pd, self.pd.engine.scheduler
        local = sched.pacer.cost.coefficients() if sched.pacer is not None else None
        remote = pd.scheduler.pacer.cost.coefficients() if pd.scheduler.pacer is not None else None
        if local is None and remote is None:             # no timings yet: the uncached length decides
            uncached = request.num_prompt_tokens - local_hit_tokens(sched.kv, request)
            if uncached <= sched.kv.block_size:
                return Choice(False, "cached")
            return Choice(uncached >= self.min_prompt_tokens, "threshold")
        local, remote = local or remote, remote or local   # one group's model stands in for the other's
        load = snapshot(pd, request, local, remote)
        if load.prompt_tokens - load.local_hit <= load.block_size:
            return Choice(False, "cached")
        local_cost, remote_cost = estimate(load, local, remote, self.link)
        return Choice(remote_cost < local_cost, "cost", local_cost, remote_cost)
