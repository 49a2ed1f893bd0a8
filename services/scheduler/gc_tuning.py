"""The scheduler process's garbage-collector settings (STEPLOOP_SCHEDULER_GC_TUNING=0 keeps CPython's).

Every step allocates a few container objects per running request (its RequestOutput, the sampled-token lists of
the worker's result, the stream chunks), and nearly all of them die within the next step. With CPython's
default thresholds (700, 10, 10) a step of 4096 decodes ran about a dozen young collections; each promoted the
step's still-live objects, and the promotions made full collections over every live request frequent: ~3 ms of
a ~10 ms step (mean, benchmarks/scheduler_step.py). A young generation of 20,000 objects lets a step's garbage
die before anything examines it, and freezing what start-up created (modules, the model's config, the service)
keeps those objects out of every later full collection. Cycles are still collected, only less often.
"""

from __future__ import annotations

import gc
import logging

from steploop.common import envs

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000


def tune() -> bool:
    """Applies the settings once start-up is done; False when switched off."""
    if envs.switched_off(envs.SCHEDULER_GC_TUNING):
        return False
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    log.debug("gc: %d start-up objects frozen, young threshold %d", gc.get_freeze_count(), YOUNG_THRESHOLD)
    return True
