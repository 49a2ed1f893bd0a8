"""How many threads a CPU step computes with, chosen from the steps' own times.

With every granted CPU computing, a neighbour that takes one core (another pod's busy loop, a build) stalls every
parallel region: the thread that shares the neighbour's core gets half of it, in scheduler slices of milliseconds,
and the others wait for it at each of the ~120 barriers of a step. On 2 cores with a busy loop on one, 64
concurrent decodes fell to 0.36x of their idle throughput with 2 threads (benchmarks/cpu_peers.py --hog), where one
thread alone would lose about half. Which is faster depends on what else runs, and that changes while serving, so
it is measured, not guessed:

- Every `explore_every` steps the governor runs `pairs` pairs of steps, one step at the current count and the next
  at a candidate (one fewer; or one more, when below the maximum, to come back once the neighbour is gone).
  Consecutive steps of a serving loop have nearly the same batch, so each pair compares like with like; the
  figure is seconds per scheduled token, and the median ratio over the pairs decides.
- The candidate wins when it is at least `min_gain` faster; then it is the new count. A probe that changes nothing
  doubles the interval (up to `max_interval` steps, and at least one probe every `max_seconds`), so an idle
  steady state pays for a few probe steps every 30 s; a switch resets it.
- A neighbour that arrives mid-run should not wait for that: when the time per token (a moving average) rises to
  `slowdown` times what it was just after the last probe, the next step starts a probe.

Results do not depend on the count: it is only used where the step's linears are the packed C kernels, whose every
output element is computed by one thread (packed_linear.c), as are the attention and elementwise kernels' rows.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from services.common import envs

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
    def __init__(self, max_threads: int, explore_every: int = 64, pairs: int = 4, min_gain: float = 0.1,
                 max_interval: int = 2048, max_seconds: float = 30.0, slowdown: float = 1.5,
                 clock=time.monotonic) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.base_interval = self.interval = explore_every
        self.max_interval = max_interval
        self.max_seconds = max_seconds     # a probe at least this often, however long the step interval grew
        self.slowdown = slowdown           # ...and at once when steps get this much slower than after the last
        self.pairs = pairs
        self.min_gain = min_gain
        self.clock = clock
        self._until_probe = explore_every
        self._last_probe = clock()
        self._probe: list[float] | None = None      # per-token seconds, alternating current / candidate
        self._candidate = 0
        self._step_threads = max_threads
        self._probe_up = False       # between 1 and the maximum: which way the next probe goes
        self._ewma: float | None = None              # per-token seconds of recent steps at the current count
        self._reference: float | None = None         # what _ewma was REFERENCE_STEPS steps after the last probe
        self._steps_since = 0

    REFERENCE_STEPS = 16

    def _pick_candidate(self) -> int:
        if self.threads >= self.max_threads:
            return self.threads - 1
        if self.threads <= 1:
            return self.threads + 1
        return self.threads + (1 if self._probe_up else -1)

    def _probe_due(self) -> bool:
        self._until_probe -= 1
        if self._until_probe <= 0 or self.clock() - self._last_probe >= self.max_seconds:
            return True
        # A neighbour that starts mid-run shows as a jump in the time per token; so does a batch that shrinks to
        # a few requests, and then the probe is only a few cheap steps.
        return (self._reference is not None and self._ewma is not None
                and self._ewma > self.slowdown * self._reference)

    def before_step(self) -> int:
        """Sets torch's thread count (which every C kernel reads) for the next step and returns it."""
        if self._probe is None and self.max_threads > 1 and self._probe_due():
            self._candidate = self._pick_candidate()
            self._probe = []
        threads = self.threads
        if self._probe is not None and len(self._probe) % 2 == 1:
            threads = self._candidate
        if threads != self._step_threads:
            torch.set_num_threads(threads)
            self._step_threads = threads
        return threads

    def after_step(self, seconds: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        per_token = seconds / num_tokens
        if self._probe is None:
            self._ewma = per_token if self._ewma is None else 0.8 * self._ewma + 0.2 * per_token
            self._steps_since += 1
            if self._steps_since == self.REFERENCE_STEPS:
                self._reference = self._ewma
            return
        self._probe.append(per_token)
        if len(self._probe) < 2 * self.pairs:
            return
        ratios = [cand / cur for cur, cand in zip(self._probe[0::2], self._probe[1::2]) if cur > 0]
        self._probe = None
        ratio = statistics.median(ratios) if ratios else 1.0
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
        self._ewma = self._reference = None
        self._steps_since = 0
        if self._step_threads != self.threads:
            torch.set_num_threads(self.threads)
            self._step_threads = self.threads
