"""The step's staging buffer (one copy for every per-step array) and the persistent device block table (diffs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steploop.gpu_worker.block_table import PersistentBlockTable
from steploop.gpu_worker.staging import StagingBuffer


def test_arrays_of_every_dtype_come_back_as_put():
    staging = StagingBuffer("cpu", capacity=128, direct=False)   # small: the second array grows it
    step = staging.begin()
    arrays = [np.arange(5, dtype=np.int64), np.array([1, -2, 3], np.int32), np.linspace(0, 1, 40).astype(np.float32),
              np.array([True, False, True]), np.zeros((0,), np.int64), np.arange(12, dtype=np.int32).reshape(3, 4)]
    slots = [step.put(a) for a in arrays]
    step.send()
    assert staging.num_grows == 1
    for slot, a in zip(slots, arrays):
        got = step.get(slot)
        assert got.shape == a.shape and got.numpy().tolist() == a.tolist()


def test_the_device_buffer_is_separate_and_later_steps_reuse_it():
    staging = StagingBuffer("cpu", direct=False)
    first = staging.begin()
    slot = first.put(np.array([7, 8], np.int64))
    first.send()
    first.host_np[:16] = 0                                   # the host side may be repacked: the sent copy stays
    assert first.get(slot).tolist() == [7, 8]
    second = staging.begin()
    assert second.host is not first.host                     # two host buffers in turn (async copies on CUDA)


def test_put_after_send_and_get_before_send_are_refused():
    step = StagingBuffer("cpu", direct=False).begin()
    slot = step.put(np.ones(2, np.int32))
    with pytest.raises(RuntimeError, match="before send"):
        step.get(slot)
    step.send()
    with pytest.raises(RuntimeError, match="after send"):
        step.put(np.ones(2, np.int32))
    with pytest.raises(TypeError, match="float64"):
        StagingBuffer("cpu").begin().put(np.ones(2))


def _sync(table: PersistentBlockTable) -> int:
    """Send the table's diffs as a step would; returns how many entries travelled."""
    step = StagingBuffer("cpu", direct=False).begin()
    table.stage(step)
    n = step.slots[0].shape[0] if step.slots else 0
    step.send()
    table.apply(step)
    return n


def test_only_diffs_travel_and_the_device_copy_matches_the_host():
    table = PersistentBlockTable(rows=2, width=2)
    table.add(10, [3, 4])
    table.add(11, [5])
    assert _sync(table) == 3
    table.append(10, [6])                                   # row 0 widens past 2: reallocated, resent
    table.add(12, [7, 8])                                   # a third row: the table doubles its rows
    _sync(table)
    assert table.device_table.numpy().tolist() == table.host.tolist()
    table.append(11, [9])
    assert _sync(table) == 1                                 # one appended block: one entry
    table.remove(10)                                         # freed and reused in the same plan: written once each
    table.add(13, [1])
    assert _sync(table) == 3
    assert table.device_table.numpy().tolist() == table.host.tolist()
    rows = torch.from_numpy(table.rows([13, 11, 12]))
    assert table.gather(rows, 3).tolist() == [[1, 0, 0], [5, 9, 0], [7, 8, 0]]
    assert _sync(table) == 0


def test_diffs_of_a_step_that_failed_before_its_copy_go_with_the_next():
    table = PersistentBlockTable(rows=2, width=4)
    table.add(1, [3, 4])
    lost = StagingBuffer("cpu").begin()
    table.stage(lost)                                        # ... and the step fails before send/apply
    table.append(1, [5])
    assert _sync(table) == 3
    assert table.device_table.numpy().tolist() == table.host.tolist()


def test_direct_mode_on_the_cpu_hands_the_arrays_over():
    staging = StagingBuffer("cpu")
    assert staging.direct
    step = staging.begin()
    a = np.arange(4, dtype=np.int64)
    slot = step.put(a)
    step.send()
    assert step.get(slot).tolist() == [0, 1, 2, 3] and not step.slots
    with pytest.raises(ValueError, match="CPU only"):
        StagingBuffer("meta", direct=True)
