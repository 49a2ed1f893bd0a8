"""--tp-collective-timeout on NCCL as on gloo: the group is built with the watchdog set to abort (not kill), and the
step's last collective is awaited on the host with the group's deadline, so a stalled peer raises CollectiveError
in the rank (which then leaves the group). Checked on the CPU with stand-in NCCL objects; gloo runs for real."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from steploop.gpu_worker.distributed import process_group
from steploop.gpu_worker.distributed.comm import CollectiveError, TensorParallelComm


class FakeWork:
    def __init__(self, done: bool = True, error: Exception | None = None):
        self.done, self.error, self.waits = done, error, 0

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        if self.done and self.error is not None:
            raise self.error
        return True            # NCCL: only the compute stream waits; the host returns at once


class FakeNccl:
    def __init__(self, work: FakeWork):
        self.work = work

    def name(self) -> str:
        return "nccl"

    def allreduce(self, tensors):
        return self.work

    def allgather(self, outputs, inputs):
        for out in outputs[0]:
            out.copy_(inputs[0])
        return self.work


def comm_with(group, seconds: float = 0.05) -> TensorParallelComm:
    comm = TensorParallelComm(rank=1, world_size=2)
    comm.attach(group, generation=3, timeout=timedelta(seconds=seconds))
    return comm


def test_nccl_stall_raises_at_the_deadline_in_the_step_gather():
    comm = comm_with(FakeNccl(FakeWork(done=False)))
    assert comm.stream_ordered
    x = torch.ones(2, 3)
    assert comm.all_reduce(x) is x          # per-layer all-reduces stay asynchronous: no host wait
    start = time.perf_counter()
    with pytest.raises(CollectiveError, match="did not finish in 0.05 s"):
        comm.all_gather_last(x)
    assert 0.04 < time.perf_counter() - start < 2.0


def test_nccl_collective_aborted_by_the_watchdog_raises():
    comm = comm_with(FakeNccl(FakeWork(done=True, error=RuntimeError("NCCL communicator was aborted"))))
    with pytest.raises(CollectiveError, match="collective failed: NCCL communicator was aborted"):
        comm.all_gather_last(torch.ones(2, 3))


def test_nccl_finished_gather_returns_the_parts():
    work = FakeWork(done=True)
    comm = comm_with(FakeNccl(work))
    out = comm.all_gather_last(torch.arange(6.0).view(2, 3))
    assert out.shape == (2, 6) and torch.equal(out[:, 3:], torch.arange(6.0).view(2, 3))
    assert work.waits == 2 and comm.take_seconds()[1] == 1


def test_nccl_group_is_built_with_the_timeout_and_abort_on_timeout(monkeypatch):
    built = {}

    class FakeProcessGroupNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, world_size, options):
            built.update(timeout=options._timeout, rank=rank, world_size=world_size,
                         handling=process_group.os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeProcessGroupNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")      # the default that kills the process
    master = process_group.GroupStore("127.0.0.1", 1)
    process_group.form_group(0, 1, master.address, 7, timedelta(seconds=12), "127.0.0.1", torch.device("cuda"),
                             master)
    assert built == {"timeout": timedelta(seconds=12), "rank": 0, "world_size": 1, "handling": "2"}


def test_gloo_path_unchanged():
    master = process_group.GroupStore("127.0.0.1", 1)
    group = process_group.form_group(0, 1, master.address, 1, timedelta(seconds=5), "127.0.0.1",
                                     torch.device("cpu"), master)
    comm = TensorParallelComm(rank=0, world_size=2)        # world 2 so the collectives really run
    comm.attach(group, 1, timedelta(seconds=5))
    assert not comm.stream_ordered
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.ones(3))
    assert comm.take_seconds()[1] == 1


def test_gloo_wait_past_the_timeout_raises():
    class SlowGloo:
        def name(self):
            return "gloo"

        def allreduce(self, tensors):
            return type("W", (), {"wait": lambda self, timeout: False})()

    comm = comm_with(SlowGloo())
    with pytest.raises(CollectiveError, match="did not finish"):
        comm.all_reduce(torch.ones(2))
