"""How many threads a CPU step computes with, chosen from the steps' own times.

With every granted CPU computing, a neighbour that takes one core (another pod's busy loop, a build) stalls every
parallel region: the thread that shares the neighbour's core gets half of it, in scheduler slices of milliseconds,
and the others wait for it at each of the ~120 barriers of a step. On 2 cores with a busy loop on one, 64
concurrent decodes fell to 0.36x of their idle throughput with 2 threads (benchmarks/cpu_peers.py --hog), where one
thread alone would lose about half. Which is faster depends on what else runs, and that changes while serving, so
it is measured, not guessed:

- Every `explore_every` steps, and at least every `max_seconds`, the governor runs pairs of consecutive steps, one
  at the current count and one at a candidate (one fewer; or one more, when below the maximum, to come back once
  the neighbour is gone), in ABBA order. Only a pair whose two steps scheduled the same number of tokens counts
  (a closed loop's decode steps mostly do); the figure is seconds per token, and the median ratio over `pairs`
  such pairs decides (no decision if a probe of 8 x `pairs` steps found too few).
- The candidate wins when it is at least `min_gain` faster; then it is the new count. A probe that changes nothing
  doubles the step interval (up to `max_interval`); a switch resets it. So an idle machine pays a few probe steps
  every 15 s, and a neighbour that arrives is noticed within ~15 s.

Results do not depend on the count: it is only used where the step's linears are the packed C kernels, whose every
output element is computed by one thread (packed_linear.c), as are the attention and elementwise kernels' rows.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from steploop.common import envs

log = logging.getLogger(__name__)


def make_thread_governor(config, device: torch.device, plan) -> ThreadGovernor | None:
    """A governor for a CPU worker whose linears are the packed C kernels and whose thread count the operator left
    to the default (--num-threads fixes it); else None."""
    if device.type != "cpu" or config.num_threads is not None or not plan.packed_linears:
        return None
    if envs.switched_off(envs.CPU_ADAPTIVE_THREADS):
        return None
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    log.info("CPU threads: up to %d, fewer while measured steps are faster with fewer (a busy neighbour); "
             "%s=0 or --num-threads keeps a fixed count", threads, envs.CPU_ADAPTIVE_THREADS)
    return ThreadGovernor(threads)


class ThreadGovernor:
    def __init__(self, max_threads: int, explore_every: int = 64, pairs: int = 4, min_gain: float = 0.15,
                 max_interval: int = 2048, max_seconds: float = 15.0, clock=time.monotonic) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.base_interval = self.interval = explore_every
        self.max_interval = max_interval
        self.max_seconds = max_seconds     # a probe at least this often, however long the step interval grew
        self.pairs = pairs
        self.min_gain = min_gain
        self.clock = clock
        self._until_probe = explore_every
        self._last_probe = clock()
        self._probe: list[tuple[int, int, float]] | None = None   # (threads, tokens, seconds per token) per step
        self._ratios: list[float] = []
        self._candidate = 0
        self._step_threads = max_threads
        self._probe_up = False       # between 1 and the maximum: which way the next probe goes

    def _pick_candidate(self) -> int:
        if self.threads >= self.max_threads:
            return self.threads - 1
        if self.threads <= 1:
            return self.threads + 1
        return self.threads + (1 if self._probe_up else -1)

    def _probe_threads(self) -> int:
        # ABBA: pair k runs (current, candidate) for even k and (candidate, current) for odd k, so neither count
        # always runs first (the first step after a change, or a batch that drifts, cannot favour one of them).
        k, second = divmod(len(self._probe), 2)
        return self._candidate if (k % 2 == 0) == (second == 1) else self.threads

    def before_step(self) -> int:
        """Sets torch's thread count (which every C kernel reads) for the next step and returns it."""
        if self._probe is None and self.max_threads > 1:
            self._until_probe -= 1
            if self._until_probe <= 0 or self.clock() - self._last_probe >= self.max_seconds:
                self._candidate = self._pick_candidate()
                self._probe, self._ratios = [], []
        threads = self.threads if self._probe is None else self._probe_threads()
        if threads != self._step_threads:
            torch.set_num_threads(threads)
            self._step_threads = threads
        return threads

    def after_step(self, seconds: float, num_tokens: int) -> None:
        if self._probe is None or num_tokens <= 0:
            return
        self._probe.append((self._step_threads, num_tokens, seconds / num_tokens))
        if len(self._probe) % 2:
            return
        (_, n0, s0), (t1, n1, s1) = self._probe[-2:]
        if n0 == n1 and s0 > 0 and s1 > 0:      # like with like only: the same tokens in both steps of the pair
            self._ratios.append(s1 / s0 if t1 == self._candidate else s0 / s1)
        if len(self._ratios) >= self.pairs or len(self._probe) >= 8 * self.pairs:
            self._decide()

    def _decide(self) -> None:
        ratio = statistics.median(self._ratios) if len(self._ratios) >= self.pairs else 1.0
        self._probe = None
        if ratio <= 1.0 - self.min_gain:
            log.info("CPU threads %d -> %d: its steps took %.2fx the time per token (a neighbour on a core, or it "
                     "went away)", self.threads, self._candidate, ratio)
            self._probe_up = self._candidate > self.threads    # keep going the way that paid
            self.threads = self._candidate
            self.interval = self.base_interval
        else:
            self.interval = min(2 * self.interval, self.max_interval)
            self._probe_up = not self._probe_up                  # next time, the other way
        self._until_probe = self.interval
        self._last_probe = self.clock()
        if self._step_threads != self.threads:
            torch.set_num_threads(self.threads)
            self._step_threads = self.threads
