"""The scheduler process's GC settings (services/scheduler/gc_tuning.py): start-up objects frozen and a wide
young generation, or CPython's own settings untouched when STEPLOOP_SCHEDULER_GC_TUNING=0."""

from __future__ import annotations

import gc

import pytest

from steploop.common import envs
from steploop.scheduler import gc_tuning


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_tune_freezes_start_up_and_widens_the_young_generation(restore_gc, monkeypatch):
    monkeypatch.delenv(envs.SCHEDULER_GC_TUNING, raising=False)
    _, middle, old = gc.get_threshold()
    assert gc_tuning.tune()
    assert gc.get_threshold() == (gc_tuning.YOUNG_THRESHOLD, middle, old)
    assert gc.get_freeze_count() > 1000          # this process's modules, at least
    assert gc.isenabled()                        # cycles are still collected


def test_switched_off_leaves_cpython_settings(restore_gc, monkeypatch):
    monkeypatch.setenv(envs.SCHEDULER_GC_TUNING, "0")
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert not gc_tuning.tune()
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
