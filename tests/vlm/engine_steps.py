"""Steps a real scheduler and a real ModelRunner together to the end, checking the block invariants after every
step (the VLM engine tests' driver)."""

from __future__ import annotations


def run(sched, runner, requests, max_steps=400):
    """Step scheduler and worker to the end; returns request id -> output tokens."""
    out = {r.request_id: [] for r in requests}
    for r in requests:
        sched.add_request(r)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        result = runner.execute(plan)
        assert not result.error, result.error
        for o in sched.update_from_output(plan, result):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    runner.execute(sched.schedule())        # the last plan's frees reach the worker
    return out
