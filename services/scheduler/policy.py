"""Scheduling policies: who waits in which order, who runs first and who is preempted.

* fcfs:     waiting in arrival order, except that preempted requests go back to the FRONT (they already paid
            for their place); running requests ranked by arrival, so the latest arrival is preempted first.
* priority: waiting and running ranked by (priority, arrival_time), lower first (vLLM's convention); the worst
            running request is preempted first, and a waiting request may preempt running ones of a strictly
            worse priority when it cannot otherwise be admitted.

Under both, background requests (the Batch API's, Request.background) form a class below every interactive
request: they wait behind them (a lane of their own in fcfs), rank after them in the running list (so they are
preempted first), and an interactive waiting head may preempt them when it cannot otherwise be admitted. The class
is the first key of every rank, so the rest of the policy is unchanged within a class.

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
    return (request.background, request.arrival_time)


def priority_rank(request: Request) -> tuple:
    return (request.background, request.priority, request.arrival_time)


def fcfs_class(request: Request) -> tuple:
    """What may preempt what under fcfs: only an interactive request a background one."""
    return (request.background,)


def priority_class(request: Request) -> tuple:
    return (request.background, request.priority)


class FCFSQueue:
    """Arrival order within two lanes, interactive before background; `push_front` for preempted requests (the
    front of their own lane). O(1) at both ends."""

    def __init__(self) -> None:
        self._lanes: tuple[deque[Request], deque[Request]] = (deque(), deque())   # [interactive, background]

    def push(self, request: Request) -> None:
        self._lanes[request.background].append(request)

    def push_front(self, request: Request) -> None:
        self._lanes[request.background].appendleft(request)

    def _head_lane(self) -> deque[Request]:
        return self._lanes[0] or self._lanes[1]

    def peek(self) -> Request:
        return self._head_lane()[0]

    def pop(self) -> Request:
        return self._head_lane().popleft()

    def remove(self, request: Request) -> None:
        self._lanes[request.background].remove(request)

    def clear(self) -> None:
        for lane in self._lanes:
            lane.clear()

    def __len__(self) -> int:
        return len(self._lanes[0]) + len(self._lanes[1])

    def __bool__(self) -> bool:
        return bool(self._lanes[0] or self._lanes[1])

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(*self._lanes)


class PriorityQueue:
    """A heap on (background, priority, arrival_time); a preempted request simply re-enters at its rank."""

    def __init__(self) -> None:
        self._heap: list[tuple[bool, int, float, int, Request]] = []
        self._tie = itertools.count()        # equal ranks leave in insertion order; never compares Requests

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.background, request.priority, request.arrival_time, next(self._tie),
                                    request))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        # O(n): aborts of waiting requests are rare next to steps.
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:-1]))


class RunningList(list):
    """Running requests, best rank first (index 0), worst last: the preemption victim is always `self[-1]`."""

    def __init__(self, rank: RankKey, klass: RankKey) -> None:
        super().__init__()
        self.rank = rank
        self.klass = klass       # the part of the rank that lets a waiting request preempt (victims_for_waiting)

    def add(self, request: Request) -> None:
        insort(self, request, key=self.rank)


def make_queues(policy: str) -> tuple[FCFSQueue | PriorityQueue, RunningList]:
    if policy == "priority":
        return PriorityQueue(), RunningList(priority_rank, priority_class)
    return FCFSQueue(), RunningList(fcfs_rank, fcfs_class)


def victims_for_waiting(head: Request, running: RunningList, kv: KVCacheManager, max_num_seqs: int,
                        watermark_blocks: int, max_new_tokens: int) -> list[Request]:
    """The running requests (worst first) that the best waiting request `head` should preempt.

    Only requests of a strictly worse class (running.klass: priority and background under the priority policy,
    background alone under fcfs), only when head cannot otherwise be admitted with up to
    max_new_tokens tokens, and only if preempting them would make it fit. The scheduler preempts them; head is
    admitted in the next step (a step that preempted admits nobody, see Scheduler.schedule)."""
    head_class = running.klass(head)
    if not running or running.klass(running[-1]) <= head_class:    # the worst is no worse: O(1), most steps
        return []
    worse = [r for r in running if running.klass(r) > head_class]   # the tail of running: ranked by class first
    if not worse:
        return []
    # Beside the requests it keeps, head must fit with what admission promised them (admission.py).
    needed = (kv.num_blocks_to_admit(head, max_new_tokens)
              + kv.num_blocks_promised([r for r in running if running.klass(r) <= head_class]))
    seats_ok = len(running) - len(worse) < max_num_seqs
    if kv.num_free_blocks + kv.num_blocks_held_alone(worse) - watermark_blocks < needed or not seats_ok:
        return []                                # preempting every worse request would not make room
    worse.reverse()
    freed_after = kv.num_blocks_freed_in_turn(worse)
    promised = [kv.num_blocks_promised([r]) for r in worse]
    kept_promised = sum(promised)                # of the worse requests not (yet) chosen as victims
    victims: list[Request] = []
    for request, promise in zip(worse, promised):
        num_left = len(running) - len(victims)
        num_free = kv.num_free_blocks + (freed_after[len(victims) - 1] if victims else 0)
        if num_left < max_num_seqs and num_free - (watermark_blocks if num_left else 0) >= needed + kept_promised:
            break
        victims.append(request)
        kept_promised -= promise
    return victims
