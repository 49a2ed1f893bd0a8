"""Small integer handles: how plans name requests, and the rules for telling the worker to drop one.

A handle is reused only after a plan that told the worker to drop it, so a new request never shares a plan with
its handle's previous owner. Small handles are reused first: they encode in fewer varint bytes.
"""

from __future__ import annotations

import heapq

from steploop.scheduler.request import Request


class HandleTable:
    def __init__(self) -> None:
        self.by_handle: dict[int, Request] = {}
        self.on_worker: set[int] = set()          # handles the worker holds (sent as new, not yet dropped)
        self._free: list[int] = []                # min-heap of reusable handles
        self._next = 0
        self._release_after_plan: list[int] = []  # dropped handles, reusable once the next plan is out
        self._finished_for_worker: list[int] = [] # dropped handles the next plan must tell the worker

    def assign(self, request: Request) -> None:
        if self._free:
            request.handle = heapq.heappop(self._free)
        else:
            request.handle, self._next = self._next, self._next + 1
        self.by_handle[request.handle] = request

    def release(self, request: Request) -> None:
        """The request is finished: forget it, and tell the worker in the next plan if it held it."""
        del self.by_handle[request.handle]
        if request.handle in self.on_worker:
            self.on_worker.discard(request.handle)
            self._finished_for_worker.append(request.handle)
        self._release_after_plan.append(request.handle)

    def unload(self, request: Request) -> bool:
        """The worker drops the request but the scheduler keeps it (preemption). True if the worker held it."""
        if request.handle in self.on_worker:
            self.on_worker.discard(request.handle)
            return True
        return False

    def take_finished(self) -> list[int]:
        out, self._finished_for_worker = self._finished_for_worker, []
        return out

    def recycle(self) -> None:
        """Called once a plan is built: the handles it dropped may be reused from the next plan on."""
        for handle in self._release_after_plan:
            heapq.heappush(self._free, handle)
        self._release_after_plan = []

    def worker_lost(self) -> None:
        self.on_worker.clear()
        self._finished_for_worker = []
