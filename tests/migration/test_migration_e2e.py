"""Acceptance: 16 streams of every kind (tests/migration/workload.py) run on one of two or three real replicas,
each with its own worker; that replica's scheduler is SIGKILLed, or drained with SIGTERM, mid-generation. Every
stream completes on the others and what each client saw (text, finish reason, logprob tokens, usage, one
[DONE]) equals the undisturbed run's: no token lost, repeated or changed."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tests.migration.replicas import Replicas, wait_for
from tests.migration.scenario import (
    NUM_ENGINE_REQUESTS,
    assert_reference_is_meaningful,
    assert_same,
    assert_survivors_idle,
    disturbed,
    reference,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 3], ids=["two-replicas", "three-replicas"])
def replicas(request, tmp_path_factory, model_dir):
    r = Replicas(tmp_path_factory.mktemp(f"migration-{request.param}"), request.param)
    try:
        yield r.start()
    finally:
        r.stop()


@pytest.fixture(scope="module")
def want(replicas):
    want = asyncio.run(reference(replicas))
    assert_reference_is_meaningful(want)
    return want


def restart_scheduler(replicas: Replicas, victim: int) -> None:
    """The victim's scheduler back (its worker reattaches), so the next test has every replica again."""
    c = replicas.clusters[victim]
    proc = c.start_service("scheduler")
    try:     # the logs of the victim's services come with a failure (one restart under a loaded full suite timed out)
        wait_for(lambda: proc.poll() is not None or c.load_report().num_total_blocks > 0, 300,
                 "the victim's worker reattached")
    except TimeoutError as err:
        raise TimeoutError(f"{err}:\n{c.logs()}") from None
    if proc.poll() is not None:
        raise RuntimeError(f"the restarted scheduler exited with {proc.returncode}:\n{c.logs()}")
    wait_for(lambda: replicas.replica_up().get(c.scheduler_address) == 1.0, 60, "the victim up")


async def test_sigkill_mid_generation(replicas, want):
    victim, before = 1, replicas.migrations()
    scheduler = replicas.clusters[victim].procs["scheduler"]
    got, at_failure = await disturbed(replicas, victim, lambda: scheduler.send_signal(signal.SIGKILL))
    assert_same(got, want)
    assert min(at_failure) >= 6
    moved = replicas.migrations()
    assert moved["replica_unavailable"] - before["replica_unavailable"] == NUM_ENGINE_REQUESTS, moved
    await assert_survivors_idle(replicas, victim)
    await asyncio.to_thread(restart_scheduler, replicas, victim)


async def test_sigterm_drain_mid_generation(replicas, want):
    victim, before = 0, replicas.migrations()     # the gateway's own cluster's scheduler: any replica drains alike
    scheduler = replicas.clusters[victim].procs["scheduler"]
    got, _ = await disturbed(replicas, victim, lambda: scheduler.send_signal(signal.SIGTERM))
    assert_same(got, want)
    moved = replicas.migrations()
    assert moved["replica_draining"] - before["replica_draining"] == NUM_ENGINE_REQUESTS, moved
    # drained: its requests left at once, so it stopped well within its --shutdown-timeout
    assert await asyncio.to_thread(scheduler.wait, 60) == 0
    await assert_survivors_idle(replicas, victim)
