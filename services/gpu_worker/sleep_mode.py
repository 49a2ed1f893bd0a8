"""SleepMode: vLLM's sleep mode on a worker rank, so a training process can have the memory while the engine is
paused (the scheduler preempted every request and cleared the prefix cache first, so no KV block is read again):

    sleep(1)   the KV cache is freed (its tensors and the C decoder's pointers into them); the weights stay in host
               memory
    sleep(2)   the weights are freed too (reloaded from the folder they came from, the latest update's if any)
    wake()     the KV cache is allocated again, zeroed, at the same size (and the weights reloaded after level 2)

Freed memory goes back to the system (the KV cache is its own mapping; glibc's malloc_trim returns freed heap
pages). The CPU worker only: on CUDA moving the weights to host memory has not run on a GPU yet, so it is refused.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    """This process's resident memory (/proc/self/statm), 0 where that does not exist."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def give_back_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):     # not glibc: freed heap stays with the process until reused
        pass


class SleepMode:
    def __init__(self, runner, allocate_kv: Callable[[], list[torch.Tensor]]) -> None:
        self.runner = runner
        self._allocate_kv = allocate_kv
        self.level = 0

    def sleep(self, level: int) -> str:
        """'' once asleep at `level`; else why not (nothing changed)."""
        runner = self.runner
        if runner.device.type != "cpu":
            return f"sleep mode runs on the CPU worker only (this one is on {runner.device.type})"
        if self.level:
            return "" if level == self.level else f"already asleep at level {self.level}"
        if level == 2 and (runner.lora is not None or runner.weights is None):
            return "sleep level 2 needs the weights' folder to reload from (and no --enable-lora); use level 1"
        before = rss_bytes()
        runner.kv_caches = []
        runner.model.cpu_decoder = None          # it points into the caches
        if level == 2:
            runner.model = None
        give_back_memory()
        self.level = level
        log.info("asleep at level %d: RSS %d -> %d MiB", level, before >> 20, rss_bytes() >> 20)
        return ""

    def wake(self) -> str:
        runner = self.runner
        if not self.level:
            return ""
        if self.level == 2:
            runner.model = runner.weights.reload()
        runner.kv_caches = self._allocate_kv()
        give_back_memory()                       # what loading the weights again used and freed (fp32 before packing)
        log.info("awake: decode steps: %s; RSS %d MiB", runner.model.bind_kv_caches(runner.kv_caches),
                 rss_bytes() >> 20)
        self.level = 0
        return ""
