"""Admission asks for room for a request's whole context (admission.py): beside running requests, a waiting
request starts only when the free blocks hold all of its tokens plus what the running ones were promised (the
rest of their prompts, their next token); alone, it starts as soon as its first chunk fits."""

from __future__ import annotations

import random

import pytest
from sched_factories import FakeWorker, Run, create_requests, create_scheduler, expected_output, run_until_idle, step

from steploop.scheduler import admission


@pytest.mark.parametrize(("prompt_len", "admitted"), [(28, True), (29, False)])
def test_a_prompt_is_admitted_beside_a_decode_only_when_its_whole_context_fits(prompt_len, admitted):
    # 12 usable blocks of 4. a (16 tokens) decodes its 17th token in 5 blocks; its next token fits them: 7 free.
    sched = create_scheduler(num_blocks=13, block_size=4, enable_prefix_caching=False)
    a, b = create_requests(2, prompt_len=[16, prompt_len], max_tokens=20, ignore_eos=True)
    sched.add_request(a)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)
    sched.add_request(b)
    plan = step(sched, worker, run)          # b's first chunk would fit either way (64-token budget, 7 blocks)
    assert bool(plan.new_requests) is admitted
    assert sched.kv.num_free_blocks == (0 if admitted else 7)
    run_until_idle(sched, worker, run)
    assert run.tokens[b.request_id] == expected_output(b)[0]


@pytest.mark.parametrize(("num_blocks", "admitted"), [(14, True), (13, False)])
def test_the_rest_of_a_running_prompt_is_kept_for_it(num_blocks, admitted):
    # a's 40-token prompt runs in chunks of 8: after its first chunk (2 blocks) it is promised 9 more
    # (11 blocks hold its 40 tokens and its first output). b (8 tokens, 2 blocks) fits only beside all of that.
    sched = create_scheduler(num_blocks=num_blocks, block_size=4, long_prefill_token_threshold=8,
                             enable_prefix_caching=False)
    a, b = create_requests(2, prompt_len=[40, 8], max_tokens=4, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    worker, run = FakeWorker(), Run()
    plan = step(sched, worker, run)
    assert [new.handle for new in plan.new_requests] == ([a.handle, b.handle] if admitted else [a.handle])
    run_until_idle(sched, worker, run)
    assert sched.num_preemptions == 0
    for r in (a, b):
        assert run.tokens[r.request_id] == expected_output(r)[0]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompts_that_outgrow_the_pool_together_are_not_admitted_to_thrash(prefix_caching, async_scheduling):
    # Six 20-token prompts (5 blocks, 6 with their first output) in chunks of 8 through 12 usable blocks, one
    # output token each: admitted at their first chunk, they preempted each other mid-prompt. Now two at a time.
    sched = create_scheduler(num_blocks=13, block_size=4, long_prefill_token_threshold=8,
                             enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    requests = create_requests(6, prompt_len=20, max_tokens=1, ignore_eos=True)
    for r in requests:
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    most_running = 0
    while sched.has_unfinished_requests():
        step(sched, worker, run)
        most_running = max(most_running, len(sched.running))
    assert sched.num_preemptions == 0 and most_running == 2
    for r in requests:
        assert run.tokens[r.request_id] == expected_output(r)[0]


def test_a_head_that_needs_most_of_the_pool_waits_for_room_and_nobody_overtakes_it():
    # a decodes in 4 blocks; b needs 11 of the 12 usable blocks: it waits until a ends, and c (small, behind it)
    # is not admitted before b; then b runs, and c beside it (b's 43 tokens and c's 3 fill the pool exactly).
    sched = create_scheduler(num_blocks=13, block_size=4, enable_prefix_caching=False)
    a, b, c = create_requests(3, prompt_len=[12, 42, 2], max_tokens=2, ignore_eos=True)
    sched.add_request(a)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)
    sched.add_request(b)
    sched.add_request(c)
    admitted = []
    while sched.has_unfinished_requests():
        plan = step(sched, worker, run)
        admitted += [sched.handles.by_handle[new.handle].request_id for new in plan.new_requests
                     if new.handle in sched.handles.by_handle]
    assert admitted[:2] == [b.request_id, c.request_id]
    assert sched.num_preemptions == 0
    for r in (a, b, c):
        assert run.tokens[r.request_id] == expected_output(r)[0]


def test_alone_a_request_starts_at_its_first_chunk_even_if_its_context_fills_the_pool():
    # 48 tokens = all 12 usable blocks: admitted with nothing running, in chunks of 8.
    sched = create_scheduler(num_blocks=13, block_size=4, long_prefill_token_threshold=8,
                             enable_prefix_caching=False, max_model_len=49)
    (a,) = create_requests(1, prompt_len=47, max_tokens=2, ignore_eos=True)
    sched.add_request(a)
    worker, run = FakeWorker(), Run()
    plan = step(sched, worker, run)
    assert plan.num_scheduled_tokens == [8]
    run_until_idle(sched, worker, run)
    assert run.tokens[a.request_id] == expected_output(a, max_model_len=49)[0]


def test_priority_head_preempts_enough_worse_requests_for_its_whole_context():
    # Two worse requests mid-prompt (16 of their 40 tokens each, promised the rest). The better head (28 tokens,
    # 7 blocks) would fit beside them by its first chunk alone; for its whole context one must go, and only one.
    sched = create_scheduler(num_blocks=25, block_size=4, long_prefill_token_threshold=8,
                             enable_prefix_caching=False, scheduling_policy="priority")
    worse = create_requests(2, prompt_len=40, max_tokens=2, ignore_eos=True, priority=1, prefix="worse")
    (head,) = create_requests(1, prompt_len=28, max_tokens=2, ignore_eos=True, priority=0, prefix="head")
    for r in worse:
        sched.add_request(r)
    worker, run = FakeWorker(), Run()
    step(sched, worker, run)
    step(sched, worker, run)
    assert [r.num_computed_tokens for r in worse] == [16, 16] and sched.kv.num_free_blocks == 16
    sched.add_request(head)
    plan = step(sched, worker, run)
    assert len(plan.preempted_handles) == 1 and worse[1].num_preemptions == 1 and worse[0].num_preemptions == 0
    plan = step(sched, worker, run)
    assert [new.handle for new in plan.new_requests] == [head.handle]
    run_until_idle(sched, worker, run)
    for r in (*worse, head):
        assert run.tokens[r.request_id] == expected_output(r)[0]


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafts", [0, 2])
def test_the_cheap_bound_on_promises_never_changes_a_decision(monkeypatch, block_size, async_scheduling, drafts):
    # admission.Promised answers from an upper bound when it leaves room and from the exact O(running) sum
    # otherwise: every answer must be the exact rule's, over tight pools, chunked prompts, drafts, one plan in
    # flight and preemptions.
    answers = {"bound": 0, "exact": 0}
    covered_by = admission.Promised.covered_by

    def checked(self, slack):
        got = covered_by(self, slack)
        exact = self.sched.kv.num_blocks_promised(self.sched.running)
        assert got == (slack >= exact)
        assert self.bound is None or self.bound >= exact
        answers["exact" if self.exact is not None else "bound"] += 1
        return got

    monkeypatch.setattr(admission.Promised, "covered_by", checked)
    rng = random.Random(block_size * 10 + drafts)
    for pool_tokens in (48, 96, 400):
        sched = create_scheduler(num_blocks=pool_tokens // block_size + 1, block_size=block_size, max_model_len=48,
                                 max_num_batched_tokens=16, long_prefill_token_threshold=rng.choice([0, 6]),
                                 async_scheduling=async_scheduling, num_speculative_tokens=drafts)
        requests = create_requests(12, prompt_len=[rng.randrange(2, 30) for _ in range(12)], max_tokens=12,
                                   ignore_eos=True, seed=pool_tokens)
        for r in requests:
            r.prompt_token_ids = r.prompt_token_ids[:8] * 4          # repeats: the n-gram drafts find some
            r.prompt_token_ids = r.prompt_token_ids[:rng.randrange(2, 30)]
            sched.add_request(r)
        run = run_until_idle(sched, FakeWorker())
        for r in requests:
            assert run.tokens[r.request_id] == expected_output(r, max_model_len=48)[0]
    assert answers["bound"] and answers["exact"]
