"""LoRA adapters as a resource of the step, like KV blocks: at most `max_loras` distinct adapters among the
running requests (so in any step), and which adapters the worker has been told about.

    steps = LoraSteps(max_loras, unloaded)   # unloaded: the engine's set of adapters unloaded via the API
    steps.can_run(request)            # its adapter already runs, or a seat is free (else it waits)
    steps.start(request, plan)        # admitted: counted, and the plan tells the worker the adapter's folder once
    steps.stop(request)               # preempted or finished while running
    steps.fill_plan(plan)             # adapters unloaded and no longer used by a live request: the worker forgets them
    steps.victims_for(head, running)  # priority policy: running requests to preempt so head's adapter gets a seat

Transport-free like the scheduler. The adapter's name is also in the first prefix-cache block's key
(services/common/block_hashing.py), so hits never cross adapters.
"""

from __future__ import annotations

from collections import Counter

from steploop.common.lora_config import LoraModule
from steploop.common.step_contract import StepPlan
from steploop.scheduler.request import Request


class LoraSteps:
    def __init__(self, max_loras: int, unloaded: set[str] | None = None) -> None:
        self.max_loras = max_loras
        self.unloaded = unloaded if unloaded is not None else set()   # shared with the engine's LoraRegistry
        self.running: Counter[str] = Counter()      # adapter -> running requests using it (no zero entries)
        self.live: Counter[str] = Counter()         # adapter -> unfinished requests using it
        self.on_worker: dict[str, str] = {}         # adapters the worker was told of: name -> folder

    def add(self, request: Request) -> None:
        if request.lora_name:
            self.live[request.lora_name] += 1

    def finish(self, request: Request) -> None:
        name = request.lora_name
        if name:
            self.live[name] -= 1
            if self.live[name] <= 0:
                del self.live[name]

    def can_run(self, request: Request) -> bool:
        name = request.lora_name
        return not name or name in self.running or len(self.running) < self.max_loras

    def start(self, request: Request, plan: StepPlan) -> None:
        name = request.lora_name
        if not name:
            return
        self.running[name] += 1
        if self.on_worker.get(name) != request.lora_path:
            self.on_worker[name] = request.lora_path
            plan.lora_loads.append(LoraModule(name, request.lora_path))

    def stop(self, request: Request) -> None:
        name = request.lora_name
        if name:
            self.running[name] -= 1
            if self.running[name] <= 0:
                del self.running[name]

    def fill_plan(self, plan: StepPlan) -> None:
        if not self.unloaded:
            return
        for name in [n for n in self.unloaded if n not in self.live]:
            self.unloaded.discard(name)
            if self.on_worker.pop(name, None) is not None:
                plan.lora_drops.append(name)

    def worker_lost(self) -> None:
        self.on_worker.clear()

    def victims_for(self, head: Request, running: list[Request]) -> list[Request]:
        """Priority policy: when head waits only for an adapter seat, the running requests of the adapter whose
        best request ranks worst, if all of them rank strictly worse than head; else none."""
        if not head.lora_name or self.can_run(head):
            return []
        best: dict[str, int] = {}
        for request in running:
            if request.lora_name:
                best[request.lora_name] = min(best.get(request.lora_name, request.priority), request.priority)
        candidates = [n for n, p in best.items() if p > head.priority]
        if not candidates:
            return []
        worst = max(candidates, key=lambda n: best[n])
        return [r for r in reversed(running) if r.lora_name == worst]

    def check(self, running: list[Request]) -> None:
        counts = Counter(r.lora_name for r in running if r.lora_name)
        assert counts == self.running, f"LoRA running counts {dict(self.running)} != {dict(counts)}"
        assert len(counts) <= self.max_loras, f"{len(counts)} adapters running, max_loras {self.max_loras}"
