"""Acceptance, cut link: replica 1 (scheduler and worker) runs in its own network namespace, reached over a veth
pair; with the workload mid-generation on it, the link goes down (no FIN, no RST: only keepalive can tell). Every
stream completes on replica 0 exactly as undisturbed, and all 18 engine requests are counted as moved."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.netns import PEER_ADDR, LinkedNamespace, netns_available
from tests.migration.replicas import Replicas
from tests.migration.scenario import (
    NUM_ENGINE_REQUESTS,
    assert_reference_is_meaningful,
    assert_same,
    assert_survivors_idle,
    disturbed,
    reference,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 for network namespaces")]


async def test_cut_link_mid_generation(tmp_path, model_dir):
    with LinkedNamespace(f"mg{int(time.time()) % 100000}") as ns:
        replicas = Replicas(tmp_path, 2, netns={1: (ns.prefix(), PEER_ADDR)})
        try:
            await asyncio.to_thread(replicas.start)
            want = await reference(replicas)
            assert_reference_is_meaningful(want)
            before = await asyncio.to_thread(replicas.migrations)
            cut_at = []

            def cut():
                ns.cut()
                cut_at.append(time.monotonic())

            got, at_failure = await disturbed(replicas, 1, cut)
            moved_after = time.monotonic() - cut_at[0]
            assert_same(got, want)
            assert min(at_failure) >= 6
            moved = await asyncio.to_thread(replicas.migrations)
            # Whichever notices first moves them: the session's keepalive (replica_unavailable) or the router's
            # health poll, whose unanswered check counts as not serving (replica_draining); seen: the poll.
            assert sum(moved.values()) - sum(before.values()) == NUM_ENGINE_REQUESTS, moved
            await assert_survivors_idle(replicas, 1)
        finally:
            ns.restore()
            replicas.stop()
    assert moved_after < 300, moved_after
