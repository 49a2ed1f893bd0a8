"""ThreadGovernor: probes one thread fewer (or more) in paired steps and keeps the count whose steps take less time
per token; torch's count (which the C kernels read) follows it. Step times here are scripted: a function of the
thread count a step ran with."""

from __future__ import annotations

import pytest
import torch

from steploop.gpu_worker.cpu_kernels import thread_governor
from steploop.gpu_worker.cpu_kernels.thread_governor import ThreadGovernor, make_thread_governor
from steploop.gpu_worker.kernel_plan import KernelPlan


@pytest.fixture
def set_threads(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def serve(gov: ThreadGovernor, seconds_per_token, steps: int, tokens: int = 64) -> list[int]:
    """Runs `steps` steps; seconds_per_token(threads) scripts the machine. Returns each step's thread count."""
    used = []
    for _ in range(steps):
        threads = gov.before_step()
        used.append(threads)
        gov.after_step(seconds_per_token(threads) * tokens, tokens)
    return used


def test_a_busy_neighbour_moves_it_to_fewer_threads_and_it_comes_back(set_threads):
    gov = ThreadGovernor(2, explore_every=8, pairs=3)
    busy = {1: 0.010, 2: 0.020}              # one core taken: the 2-thread steps wait at every barrier
    used = serve(gov, busy.get, 8 + 6)
    assert used[:7] == [2] * 7 and used[7:13] == [2, 1, 1, 2, 2, 1]      # ABBA pairs
    assert gov.threads == 1 and set_threads[-1] == 1
    idle = {1: 0.020, 2: 0.011}              # the neighbour is gone: the probe of 2 wins it back
    used = serve(gov, idle.get, 8 + 6)
    assert 2 in used and gov.threads == 2 and set_threads[-1] == 2


def test_only_pairs_of_equal_steps_count(set_threads):
    """A pair whose steps scheduled different token counts (a prompt chunk joined one of them) says nothing."""
    gov = ThreadGovernor(2, explore_every=1, pairs=2)
    tokens = iter([64, 80] * 8)              # every pair mismatched: no decision, the count stays
    for _ in range(16):
        threads = gov.before_step()
        gov.after_step((0.005 if threads == 1 else 0.02) * 64, next(tokens))
    assert gov.threads == 2
    for _ in range(8):                       # now equal pairs: 1 thread is 4x faster per token
        threads = gov.before_step()
        gov.after_step((0.005 if threads == 1 else 0.02) * 64, 64)
    assert gov.threads == 1


def test_a_probe_that_changes_nothing_backs_off(set_threads):
    gov = ThreadGovernor(2, explore_every=4, pairs=2, max_interval=16)
    steady = {1: 0.020, 2: 0.0105}
    used = serve(gov, steady.get, 200)
    assert gov.threads == 2
    probes = sum(1 for t in used if t == 1)
    # intervals 4, 8, 16, 16, ...: ~200 / 20 probes of 2 candidate steps each, not 200 / 8
    assert 2 <= probes <= 2 * (200 // 16 + 2) and gov.interval == 16
    assert all(t in (1, 2) for t in set_threads)


def test_a_gain_below_the_threshold_keeps_the_count(set_threads):
    gov = ThreadGovernor(2, explore_every=4, pairs=3, min_gain=0.15)
    serve(gov, {1: 0.009, 2: 0.010}.get, 4 + 6)        # 10% faster with 1: noise, not a reason to switch
    assert gov.threads == 2


def test_only_for_cpu_packed_linears_and_a_default_thread_count(monkeypatch):
    class Config:
        num_threads = None

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cpu, packed = torch.device("cpu"), KernelPlan(packed_linears=True)
    assert make_thread_governor(Config, cpu, packed) is not None
    assert make_thread_governor(Config, cpu, KernelPlan(packed_linears=False)) is None   # torch linears
    assert make_thread_governor(Config, torch.device("meta"), packed) is None            # not a CPU
    Config.num_threads = 2                                                               # the operator's
    assert make_thread_governor(Config, cpu, packed) is None
    Config.num_threads = None
    monkeypatch.setenv("STEPLOOP_CPU_ADAPTIVE_THREADS", "0")
    assert make_thread_governor(Config, cpu, packed) is None
    monkeypatch.delenv("STEPLOOP_CPU_ADAPTIVE_THREADS")
    monkeypatch.setattr(thread_governor.torch, "get_num_threads", lambda: 1)
    assert make_thread_governor(Config, cpu, packed) is None                             # nothing to adapt


def test_probes_at_least_every_max_seconds(set_threads):
    now = [0.0]
    gov = ThreadGovernor(2, explore_every=10_000, max_interval=10_000, pairs=2, max_seconds=30.0,
                         clock=lambda: now[0])
    used = []
    for _ in range(50):
        now[0] += 1.0                                           # one step a second
        used.append(gov.before_step())
        gov.after_step(0.64 if used[-1] == 2 else 1.2, 64)
    assert used.index(1) == 30 and gov.threads == 2            # a probe from 30 s on (current, then 1), kept 2
