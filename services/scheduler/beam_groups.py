"""Beam search inside the scheduler (vLLM's `use_beam_search`; the ranking is common/beam_ranking.py's, the one
rule the engine has, equal to transformers' `generate(num_beams=W)`).

A beam group is one client request, never queued itself, and its live beams, each a BeamRequest: an ordinary
request to the queues, the budget and the worker (a greedy, ignore_eos request asking for the top K logprobs).

One round: every live beam computes up to its last token; its result gives the top K logprobs after it and the
token the worker sampled (the worker's own next input). The token is not appended: the beam parks (its gap is
0). Once every beam of the group is back, the ranking picks the next W beams, each a (parent, token):

  * the parent's first child continues as the parent's request: the token is appended. If it is not the token
    the worker sampled, the worker gets the request again as new (same handle, same blocks, num_computed_tokens
    as before: nothing is recomputed);
  * each further child is a new BeamRequest forked from the parent (KVCacheManager.fork: the full blocks shared,
    the partial last block copied on write by the worker before the next forward); it is sent as new with the
    parent's num_computed_tokens and joins the running list beside its siblings. A fork that finds no free
    block or no seat (max_num_seqs) waits at the front of the queue and is recomputed (its prefix hits);
  * a parent with no child finishes, and its blocks go back.

When the ranking is done every beam finishes and the group's request gets one output with the hypotheses.

Scheduling keeps a group whole: its running beams are scheduled together (schedule_group) once the blocks they
need are free, preempting requests ranked below them (a whole group when the victim is a beam); preempting one
beam preempts its whole group; an abort or a failed step ends every beam. Under async scheduling a beam never
runs ahead (no output placeholder): it waits for its round's ranking, so a group runs every other step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from steploop.common.beam_ranking import BeamRanking, Hypothesis
from steploop.common.intmath import cdiv
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import NewRequestData, StepPlan, TokenLogprob
from steploop.scheduler.request import Request, RequestOutput, RequestRejectedError, RequestStatus

if TYPE_CHECKING:
    from steploop.scheduler.scheduler import Scheduler

RUNNING = RequestStatus.RUNNING
MAX_BEAM_WIDTH = 16


@dataclass(eq=False, slots=True)
class BeamRequest(Request):
    """One live beam. A subclass, so the C decode loops (exact type check) leave it to the Python path."""

    group: BeamGroup | None = None
    top: list[tuple[int, float]] | None = None   # this round's top K after its tokens; None: not back yet
    sampled: int = -1                            # the token the worker sampled after them (its next input)
    resend: bool = False                         # its token is not the worker's: send it again as new


@dataclass(slots=True)
class BeamOutput(RequestOutput):
    """A beam group's one output (its client request's id). A subclass: the plain RequestOutput is built field
    by field by the C decode loop."""

    beams: list[Hypothesis] | None = None    # the hypotheses, best first; None when it did not complete


class BeamGroup:
    def __init__(self, request: Request, ranking: BeamRanking, sampling: SamplingParams) -> None:
        self.request = request               # the client's request (its id names the group's output)
        self.ranking = ranking
        self.sampling = sampling             # every beam's: greedy, ignore_eos, the top K logprobs
        self.beams: list[BeamRequest] = []   # aligned with ranking.running
        self.num_made = 0                    # beams made so far (their ids)
        self.scheduled_step = -1             # the plan that last scheduled the group (schedule_group)
        self.cached_tokens = 0               # prompt tokens found cached at the first admission (usage)
        self.moves: list[tuple[BeamRequest, int, bool]] = []   # ranked: (parent, token, continues the parent)


def start(sched: Scheduler, request: Request) -> None:
    """Validate the client's request (add_request's checks ran) and queue its first beam (the prompt)."""
    config = request.beam
    if not 1 <= config.width <= MAX_BEAM_WIDTH:
        raise RequestRejectedError(f"beam search takes 1 to {MAX_BEAM_WIDTH} beams, got {config.width}",
                                   "invalid_value", "n")
    for name, used in (("prompt_logprobs", request.sampling.prompt_logprobs >= 0),
                       ("resume_output_token_ids", bool(request.output_token_ids))):
        if used:
            raise RequestRejectedError(f"'{name}' cannot be used with beam search", "invalid_value", name)
    if config.width > sched.config.max_num_seqs:
        raise RequestRejectedError(f"{config.width} beams need {config.width} sequences but the scheduler runs at "
                                   f"most {sched.config.max_num_seqs} (--max-num-seqs)", "invalid_value", "n")
    bs, prompt = sched.kv.block_size, len(request.prompt_token_ids)
    shared = prompt // bs                    # the prompt's full blocks: every beam shares them
    alone = shared + config.width * (cdiv(prompt + request.max_output_tokens, bs) - shared + 1)
    if alone > sched.kv.num_usable_blocks:   # + 1: a fork's copy holds its source until the plan is out
        raise RequestRejectedError(f"{config.width} beams of {prompt} + {request.max_output_tokens} tokens may need "
                                   f"{alone} KV blocks but the cache has {sched.kv.num_usable_blocks}: fewer beams "
                                   f"or a lower max_tokens", "kv_cache_too_small", "max_tokens")
    ranking = BeamRanking(config, request.max_output_tokens, request.stop_ids)
    sampling = SamplingParams(temperature=0.0, max_tokens=request.max_output_tokens, ignore_eos=True,
                              logprobs=max(ranking.k, request.sampling.logprobs))
    group = BeamGroup(request, ranking, sampling)
    sched.beam_groups[request.request_id] = group
    group.beams.append(_make_beam(sched, group, []))
    sched.waiting.push(group.beams[0])


def _make_beam(sched: Scheduler, group: BeamGroup, output_ids: list[int]) -> BeamRequest:
    req = group.request
    beam = BeamRequest(f"{req.request_id}/beam{group.num_made}", req.prompt_token_ids,
                       output_token_ids=output_ids, sampling=group.sampling, priority=req.priority,
                       background=req.background, arrival_time=req.arrival_time, cache_salt=req.cache_salt,
                       lora_name=req.lora_name, lora_path=req.lora_path, mm_features=req.mm_features, group=group)
    group.num_made += 1
    beam.num_prompt = len(beam.prompt_token_ids)
    sched.stop_rules.encode(beam)
    beam.status = RequestStatus.WAITING
    sched.handles.assign(beam)
    sched.lora.add(beam)
    sched.requests[beam.request_id] = beam
    return beam


# ----------------------------------------------------------------------------------------------- schedule
def schedule_group(sched: Scheduler, plan: StepPlan, first: BeamRequest, budget: int, scheduled: list[Request],
                   ends: list[int]) -> int:
    """The running beams of first's group that have tokens to compute, together (from running_pass); returns the
    budget left. Their blocks are found first, preempting the worst running requests (never a beam of this
    group alone: reaching one preempts the group, and nothing of it is in the plan yet)."""
    group, kv = first.group, sched.kv
    group.scheduled_step = plan.step_id
    wants, left = [], budget
    for beam in group.beams:
        if beam.status is RUNNING and left > 0:
            num_new = sched._num_new_tokens(beam, left)
            if num_new > 0:
                wants.append((beam, num_new))
                left -= num_new
    if not wants:
        return budget
    table_len = lambda b: len(kv.get_block_ids(b))
    while sum(max(cdiv(b.num_computed_tokens + n, kv.block_size) - table_len(b), 0)
              for b, n in wants) > kv.num_free_blocks:
        victim = sched.running[-1]
        sched._preempt(victim, plan)
        if isinstance(victim, BeamRequest) and victim.group is group:
            return budget
    for beam, num_new in wants:
        computed = beam.num_computed_tokens
        new_blocks = kv.allocate_slots(beam, num_new)
        if new_blocks:
            plan.cached.append(beam.handle, computed, new_blocks)
        sched._add_to_batch(plan, beam, num_new, scheduled, ends)
        budget -= num_new
    return budget


def send_new(sched: Scheduler, plan: StepPlan) -> None:
    """At the start of schedule(): the plan carries, as new, the forks of the last ranking and the beams whose
    token is not the worker's (dropped first, same handle), with their blocks and computed tokens."""
    sends, sched.beam_sends = sched.beam_sends, []
    for beam in sends:
        if beam.status is not RUNNING:       # preempted or finished since: nothing to send
            continue
        if sched.handles.unload(beam):       # it is on the worker with another next token
            plan.preempted_handles.append(beam.handle)
        beam.resend = False
        sched.handles.on_worker.add(beam.handle)
        plan.new_requests.append(NewRequestData(
            handle=beam.handle, prompt_token_ids=list(beam.prompt_token_ids),
            output_token_ids=list(beam.output_token_ids), sampling=beam.sampling,
            block_ids=list(sched.kv.get_block_ids(beam)), num_computed_tokens=beam.num_computed_tokens,
            lora_name=beam.lora_name or "", mm_features=beam.mm_features))


def break_stall(sched: Scheduler, plan: StepPlan) -> None:
    """Nothing was scheduled and nothing is in flight, yet requests wait: when every running request is a beam
    parked for siblings still in the queue (groups re-admitted one beam at a time after a preemption, which the
    pool cannot hold together), preempt the worst group and queue it last (fcfs), so the others go on."""
    running = sched.running
    if not (running and sched.waiting) or not all(type(r) is BeamRequest and r.top is not None for r in running):
        return
    group = running[-1].group
    preempt_group(sched, group, plan)
    if sched.config.scheduling_policy != "priority":
        for beam in group.beams:
            if beam.status is RequestStatus.PREEMPTED:
                sched.waiting.remove(beam)
                sched.waiting.push(beam)


def preempt_group(sched: Scheduler, group: BeamGroup, plan: StepPlan) -> None:
    """Every running beam of the group, worst first (so the best ends at the front of the queue). A beam sent as
    new in this very plan is taken out of it again (the worker must not add what it is told to drop)."""
    members = [b for b in group.beams if b.status is RUNNING]
    handles = {b.handle for b in members}
    if plan.new_requests:
        plan.new_requests[:] = [n for n in plan.new_requests if n.handle not in handles]
    for beam in reversed(members):
        beam.resend = False
        sched._preempt_one(beam, plan)


# ----------------------------------------------------------------------------------------------- results
def on_result(sched: Scheduler, beam: BeamRequest, token: int, logprobs: list[TokenLogprob] | None) -> None:
    """A beam's round is back: keep its top K and park it."""
    if not logprobs:
        raise RuntimeError(f"{beam.request_id}: the worker returned no logprobs for a beam")
    lp = logprobs[0]
    beam.top = list(zip(lp.top_token_ids, lp.top_logprobs))
    beam.sampled = token


def advance(sched: Scheduler, groups: list[BeamGroup]) -> list[RequestOutput]:
    """Rank the groups whose every beam is back (and running); outputs for the groups that finished."""
    outputs = []
    for group in groups:
        if group.request.request_id not in sched.beam_groups:
            continue
        if all(b.top is not None and b.status is RUNNING for b in group.beams):
            out = _rank(sched, group)
            if out is not None:
                outputs.append(out)
    return outputs


def _rank(sched: Scheduler, group: BeamGroup) -> RequestOutput | None:
    """Rank the round: the group ends, or its next beams wait for the next schedule() (apply_moves), where the
    room they need can be made by preemption."""
    ranking, old = group.ranking, group.beams
    if not ranking.t:                        # usage's cached tokens: the prompt's first admission
        group.cached_tokens = old[0].num_cached_tokens
    ranking.step([b.top for b in old])
    if ranking.done:
        return finish(sched, group, RequestStatus.FINISHED_STOPPED)
    continues = [False] * len(old)
    group.moves = []
    for beam in ranking.running:
        group.moves.append((old[beam.parent], beam.tokens[-1], not continues[beam.parent]))
        continues[beam.parent] = True
    for beam in old:
        beam.top = None
    sched.beam_ready.append(group)
    return None


def apply_moves(sched: Scheduler, plan: StepPlan) -> None:
    """At the start of schedule(): each ranked group becomes its next beams. The forks need a free block each
    (those whose parent's last block is partial) and seats (max_num_seqs): requests ranked below the group are
    preempted for them; reaching a beam of the group preempts the group instead, and then its next beams are
    made in the queue (recomputed from their tokens, prefix hits)."""
    ready, sched.beam_ready = sched.beam_ready, []
    kv, block_size = sched.kv, sched.kv.block_size
    for group in ready:
        if group.request.request_id not in sched.beam_groups:
            continue
        forks = [p for p, _, cont in group.moves if not cont]
        num_dropped = sum(1 for b in group.beams if not any(p is b for p, _, _ in group.moves))
        blocks = sum(1 for p in forks if p.num_computed_tokens % block_size)
        while all(b.status is RUNNING for b in group.beams) and (
                kv.num_free_blocks < blocks
                or len(sched.running) + len(forks) - num_dropped > sched.config.max_num_seqs):
            sched._preempt(sched.running[-1], plan)      # a beam of this group preempts the whole group
        _move(sched, group)


def _move(sched: Scheduler, group: BeamGroup) -> None:
    moves, old = group.moves, group.beams
    running = all(b.status is RUNNING for b in old)
    new = [p if cont else _fork(sched, group, p, token, running) for p, token, cont in moves]  # before parents move
    for parent, token, cont in moves:
        if cont:
            parent.output_token_ids.append(token)
            if running and token != parent.sampled:
                parent.resend = True
                sched.beam_sends.append(parent)
    for beam in old:
        if not any(beam is b for b in new):
            sched._finish(beam, RequestStatus.FINISHED_STOPPED)
    group.beams, group.moves = new, []


def _fork(sched: Scheduler, group: BeamGroup, parent: BeamRequest, token: int, running: bool) -> BeamRequest:
    child = _make_beam(sched, group, parent.output_token_ids + [token])
    child.num_cached_tokens = parent.num_cached_tokens
    child.block_hashes = parent.block_hashes[:parent.num_computed_tokens // sched.kv.block_size]
    if running:
        assert sched.kv.fork(parent, child, group.request.request_id), "apply_moves made no room"
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RUNNING
        sched.running.add(child)
        sched.lora.start(child, StepPlan(step_id=-1))   # its adapter is on the worker: the parent runs with it
        sched.beam_sends.append(child)
    else:                                    # the group is in the queue: the child is recomputed with it
        child.status = RequestStatus.PREEMPTED
        sched.waiting.push_front(child)
    return child


def finish(sched: Scheduler, group: BeamGroup, status: RequestStatus, error: str = "") -> RequestOutput:
    """End every beam and the group: the output for the client's request (the hypotheses when it completed)."""
    for beam in group.beams:
        if not beam.is_finished:
            sched._finish(beam, status)
    del sched.beam_groups[group.request.request_id]
    req, done = group.request, status == RequestStatus.FINISHED_STOPPED
    beams = group.ranking.finished if done else None
    num_output = max((len(h.tokens) for h in beams), default=0) if beams else 0
    return BeamOutput(req.request_id, [], None, status, None, len(req.prompt_token_ids), num_output,
                      group.cached_tokens, error=error, beams=beams)


def fail(sched: Scheduler, beam: BeamRequest, error: str) -> RequestOutput | None:
    """A beam's step failed: its group ends with the error (None if the group already ended)."""
    group = beam.group
    if group.request.request_id not in sched.beam_groups:
        return None
    return finish(sched, group, RequestStatus.FINISHED_ERROR, error)


def drained(sched: Scheduler, requests: list[Request]) -> list[Request]:
    """drain_requests' list with each group's beams replaced by its client request (searched again elsewhere)."""
    out, seen = [], set()
    for request in requests:
        if isinstance(request, BeamRequest):
            req = request.group.request
            if req.request_id not in seen:
                seen.add(req.request_id)
                out.append(req)
        else:
            out.append(request)
    sched.beam_groups.clear()
    sched.beam_sends, sched.beam_ready = [], []
    return out


def check(sched: Scheduler) -> None:
    """Every group's beams are live requests of it, W at most; every live beam belongs to a live group."""
    for gid, group in sched.beam_groups.items():
        assert len(group.beams) <= group.ranking.config.width, f"{gid}: {len(group.beams)} beams"
        for beam in group.beams:
            assert sched.requests.get(beam.request_id) is beam and beam.group is group, beam.request_id
            assert beam.num_output_placeholders == 0, f"{beam.request_id} runs ahead"
    for request in sched.requests.values():
        if isinstance(request, BeamRequest):
            assert sched.beam_groups.get(request.group.request.request_id) is request.group, request.request_id
