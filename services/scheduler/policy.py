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

from steploop.scheduler.kv_cache_manager import KVCacheManager
from steploop.scheduler.request import Request

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


def victims_for_waiting(head: Request, running: RunningList, kv: KVCacheManager, max_num_seqs: int,
                        watermark_blocks: int, max_new_tokens: int) -> list[Request]:
    """Priority policy: the running requests (worst first) that the best waiting request `head` should preempt.

    Only requests of a strictly worse priority, only when head cannot otherwise be admitted with up to
    max_new_tokens tokens, and only if preempting them would make it fit. The scheduler preempts them; head is
    admitted in the next step (a step that preempted admits nobody, see Scheduler.schedule)."""
    worse = [r for r in running if r.priority > head.priority]   # the tail of running: ranked by priority
    if not worse:
        return []
    needed = kv.num_blocks_to_admit(head, max_new_tokens)
    seats_ok = len(running) - len(worse) < max_num_seqs
    if kv.num_free_blocks + kv.num_blocks_held_alone(worse) - watermark_blocks < needed or not seats_ok:
        return []                                # preempting every worse request would not make room
    worse.reverse()
    freed_after = kv.num_blocks_freed_in_turn(worse)
    victims: list[Request] = []
    for request in worse:
        num_left = len(running) - len(victims)
        num_free = kv.num_free_blocks + (freed_after[len(victims) - 1] if victims else 0)
        if num_left < max_num_seqs and num_free - (watermark_blocks if num_left else 0) >= needed:
            break
        victims.append(request)
    return victims
