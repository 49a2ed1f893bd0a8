"""Property-based runs (hypothesis): every feature combination against random workloads.

Sync and async scheduling, prefix cache on/off, n-gram speculation on/off, fcfs/priority; random arrivals with
shared prefixes and cache salts, budgets, pools, aborts, step errors and worker losses. After every step the
invariants of DESIGN.md hold (sched_factories.check_plan / check_integrity); at the end the pool is whole,
every request finished, and each one that was neither aborted nor failed produced exactly the tokens of an
unconstrained run.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_factories import (
    EOS,
    AsyncDriver,
    FakeWorker,
    assert_idle,
    create_scheduler,
    expected_output,
)

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.request import Request, RequestRejectedError, RequestStatus


def loopy_model(tokens: list[int]) -> int:
    """Depends on the last two tokens only, from a small vocabulary: text repeats, so n-gram drafts hit."""
    a, b = tokens[-1], tokens[-2] if len(tokens) > 1 else 0
    t = (a * 3 + b) % 7
    return EOS if t == 0 and a % 4 == 0 else 10 + t


PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [30, 31, 30, 31, 30, 31, 30], []]

configs = st.fixed_dictionaries({
    "async_scheduling": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "num_speculative_tokens": st.sampled_from([0, 0, 2, 4]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "max_num_seqs": st.sampled_from([1, 2, 4, 8]),
    "max_num_batched_tokens": st.sampled_from([8, 16, 64]),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 5]),
    "num_blocks": st.sampled_from([10, 24, 80]),
    "block_size": st.sampled_from([1, 4, 16]),
    "max_model_len": st.sampled_from([48, 1024]),
    "admission_watermark": st.sampled_from([0.0, 0.1]),
})

requests = st.builds(
    lambda prefix, suffix, max_tokens, ignore_eos, priority, salt: (
        PREFIXES[prefix] + suffix, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), priority, salt),
    st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(10, 40), min_size=1, max_size=12),
    st.integers(1, 25), st.booleans(), st.integers(0, 2), st.sampled_from([None, None, "tenant-a"]))

events = st.lists(st.tuples(st.lists(requests, max_size=3),                  # arrivals before this step
                            st.sampled_from(["", "", "", "", "", "", "", "", "abort", "lose", "fail"])),
                  min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, script=events)
def test_any_schedule_gives_the_unconstrained_tokens(config, script):
    config = dict(config)
    if config["max_num_seqs"] > config["max_num_batched_tokens"]:
        config["max_num_seqs"] = config["max_num_batched_tokens"]
    sched = create_scheduler(**config)
    driver = AsyncDriver(sched, FakeWorker(block_size=sched.kv.block_size, model=loopy_model))
    accepted, broken = {}, set()
    for i in range(10_000):
        arrivals, event = script[i] if i < len(script) else ([], "")
        for j, (prompt, sampling, priority, salt) in enumerate(arrivals):
            req = Request(f"r{i}.{j}", list(prompt), sampling=sampling, priority=priority, arrival_time=i + j / 10,
                          cache_salt=salt)
            if _try_add(sched, req):
                accepted[req.request_id] = req
        _apply(event, sched, driver, broken)
        if i >= len(script) and not driver.busy():
            break
        if sched.config.async_scheduling:
            driver.step()
        else:
            driver.step()
            driver.flush()
        broken.update(rid for rid, s in driver.run.finish.items() if s == RequestStatus.FINISHED_ERROR)
    assert_idle(sched)
    assert set(driver.run.finish) == set(accepted), "every request finishes"
    for rid, req in accepted.items():
        want, reason = expected_output(req, sched.max_model_len, model=loopy_model)
        got = driver.run.tokens.get(rid, [])
        if rid in broken:
            assert got == want[:len(got)], rid
        else:
            assert (got, driver.run.finish[rid]) == (want, reason), rid
    stats = sched.kv.prefix_cache_stats
    assert 0 <= stats.hits <= stats.queries
    assert sched.stats.num_accepted_tokens <= sched.stats.num_draft_tokens


def _apply(event: str, sched, driver: AsyncDriver, broken: set[str]) -> None:
    live = [r.request_id for r in list(sched.running) + list(sched.waiting)]
    if event == "abort" and live:
        victims = live[::3]
        driver.run.collect(sched.abort_requests(victims))
        broken.update(victims)
    elif event == "lose":
        sched.preempt_all()                        # worker lost; its result in flight (if any) is stale
        driver.flush()
        driver.worker = FakeWorker(block_size=sched.kv.block_size, model=loopy_model)
    elif event == "fail":
        driver.worker.fail_steps = {sched._next_step_id}


def _try_add(sched, req: Request) -> bool:
    try:
        sched.add_request(req)
    except RequestRejectedError:
        return False
    return True
