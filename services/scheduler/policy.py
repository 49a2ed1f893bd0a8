"""Scheduling policies: who waits in which order, who runs first and who is preempted.

* fcfs:     waiting in arrival order, except that preempted requests go back to the FRONT (they already paid
            for their place); running requests ranked by arrival, so the latest arrival is preempted first.
* priority: waiting and running ranked by (priority, arrival_time), lower first (vLLM's convention); the worst
            running request is preempted first, and a waiting request may preempt running ones of a strictly
            worse priority when it cannot otherwise be admitted.

The running list is kept sorted by rank as requests join (bisect), so a step never sorts it.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import insort
from collections import deque
from collections.abc import Iterator
from typing import Callable

from services.scheduler.request import Request

RankKey = Callable[[Request], tuple]


def fcfs_rank(request: Request) -> tuple:
    return (request.arrival_time,)


def priority_rank(request: Request) -> tuple:
    return (request.priority, request.arrival_time)


class FCFSQueue:
    """Arrival order; `push_front` for preempted requests. O(1) at both ends."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_front(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def clear(self) -> None:
        self._q.clear()

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """A heap on (priority, arrival_time); a preempted request simply re-enters at its rank."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tie = itertools.count()        # equal ranks leave in insertion order; never compares Requests

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tie), request))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        # O(n): aborts of waiting requests are rare next to steps.
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


class RunningList(list):
    """Running requests, best rank first (index 0), worst last: the preemption victim is always `self[-1]`."""

    def __init__(self, rank: RankKey) -> None:
        super().__init__()
        self.rank = rank

    def add(self, request: Request) -> None:
        insort(self, request, key=self.rank)


def make_queues(policy: str) -> tuple[FCFSQueue | PriorityQueue, RunningList]:
    if policy == "priority":
        return PriorityQueue(), RunningList(priority_rank)
    return FCFSQueue(), RunningList(fcfs_rank)


def preempt_for_waiting(sched, plan) -> None:
    """Priority policy: the best waiting request preempts running requests of a strictly worse priority (worst
    first) when it cannot otherwise be admitted, and only if that would make it fit. It is admitted in the next
    step: a step that preempted admits nobody (see Scheduler.schedule)."""
    head, running, kv = sched.waiting.peek(), sched.running, sched.kv
    worse = [r for r in running if r.priority > head.priority]
    if not worse:
        return
    needed = _blocks_to_admit(sched, head)
    freeable = sum(1 for r in worse for b in kv.get_block_ids(r) if kv.pool.ref_cnt[b] == 1)
    seats_ok = len(running) - len(worse) < sched.config.max_num_seqs
    if kv.num_free_blocks + freeable - sched.watermark_blocks < needed or not seats_ok:
        return                                   # preempting every worse request would not make room
    while running and running[-1].priority > head.priority and (
            len(running) >= sched.config.max_num_seqs
            or kv.num_free_blocks - (sched.watermark_blocks if running else 0) < needed):
        sched._preempt(running[-1], plan)


def _blocks_to_admit(sched, request: Request) -> int:
    """Free blocks that admitting `request` with a full step's budget would take (cached hits reused)."""
    kv = sched.kv
    hits, num_hit = kv.get_computed_blocks(request)
    chunk = request.num_tokens - num_hit
    threshold = sched.config.long_prefill_token_threshold
    chunk = min(chunk, sched.config.max_num_batched_tokens, threshold if threshold > 0 else chunk)
    num_blocks = -(-(num_hit + chunk) // kv.block_size)
    return num_blocks - len(hits) + sum(1 for b in hits if kv.pool.ref_cnt[b] == 0)
