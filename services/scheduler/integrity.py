"""check_scheduler: the invariants of DESIGN.md over a Scheduler's queues, counters and blocks (tests call it
after every step; it is O(pool + requests), so not on the serving path)."""

from __future__ import annotations

from steploop.scheduler.request import RequestStatus


def check_scheduler(sched) -> None:
    kv = sched.kv
    kv.check_integrity()
    assert len(sched.running) <= sched.config.max_num_seqs, f"{len(sched.running)} running > max_num_seqs"
    for request in sched.running:
        assert request.status == RequestStatus.RUNNING, f"{request.request_id} running as {request.status!r}"
        covered = len(kv.get_block_ids(request)) * kv.block_size
        assert covered >= request.num_computed_tokens, (
            f"{request.request_id}: {request.num_computed_tokens} computed tokens but blocks cover {covered}")
    for request in sched.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request.status
        assert request.num_computed_tokens == 0 and not kv.get_block_ids(request), request.request_id
        assert request.num_output_placeholders == 0, request.request_id
    for request in sched.requests.values():      # the hot loops read the prompt length from num_prompt
        assert request.num_prompt == len(request.prompt_token_ids), f"{request.request_id}: stale num_prompt"
    live = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
    assert len(live) == len(sched.running) + len(sched.waiting) == len(sched.requests), "queues disagree"
    assert set(kv.request_ids) <= live, f"blocks held by dead requests: {set(kv.request_ids) - live}"
    ranks = [sched.running.rank(r) for r in sched.running]
    assert ranks == sorted(ranks), "running list out of rank order"
