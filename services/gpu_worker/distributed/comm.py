"""TensorParallelComm: the collectives a sharded forward calls (all-reduce, all-gather), over the process group
its ranks formed (process_group.py), each bounded by the group's timeout.

A collective that fails or times out raises CollectiveError; the worker then leaves the group and breaks its plan
stream, which the scheduler treats as the whole group lost. Before a group exists (the start-up memory profile)
`local_only` lets the forward run without talking to anyone: shapes and memory are right, values are not used.

gloo's `work.wait(timeout)` blocks the host, so every collective is bounded where it is called. NCCL's only makes
the compute stream wait: the host runs ahead and a stalled peer would surface only in NCCL's watchdog, which by
default kills the process. So on NCCL (the group formed with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, process_group.py:
the watchdog aborts the communicator at the group's timeout instead) the step's last collective, the vocabulary
all-gather, is awaited on the host with the same deadline: NCCL runs one group's collectives in order on one
stream, so its completion covers every all-reduce before it, and a stall anywhere in the step raises here, once
per step, as on gloo.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch

from steploop.gpu_worker.kv_cache_dtype import as_bytes

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective failed or ran past the group's timeout: the group is broken."""


class TensorParallelComm:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.group = None                # a torch.distributed ProcessGroup, set when the group forms
        self.generation = -1
        self.timeout = timedelta(seconds=30)
        self.local_only = False          # True only while profiling memory before a group exists
        self.seconds = 0.0               # time spent in collectives since the last take_seconds()
        self.calls = 0
        self.stream_ordered = False      # NCCL: collectives complete on the device, after the host moved on

    def attach(self, group, generation: int, timeout: timedelta) -> None:
        self.group, self.generation, self.timeout = group, generation, timeout
        self.stream_ordered = _backend(group) == "nccl"     # wait() does not block the host (module doc)

    def detach(self) -> None:
        """Leave the group. NCCL needs its communicators aborted (a peer may be gone mid-collective); gloo's
        pairs close when the group object is dropped."""
        group, self.group = self.group, None
        abort = getattr(group, "abort", None)
        if abort is not None:
            try:
                abort()
            except Exception as exc:  # noqa: BLE001 - leaving a broken group: nothing more to do with it
                log.debug("aborting the old process group: %s", exc)

    @property
    def ready(self) -> bool:
        return self.world_size == 1 or self.group is not None

    def take_seconds(self) -> tuple[float, int]:
        """(seconds in collectives, number of collectives) since the last call."""
        out, self.seconds, self.calls = (self.seconds, self.calls), 0.0, 0
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.world_size == 1 or self.local_only:
            return x
        self._run(lambda g: g.allreduce([x]))
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise max over ranks, in place (FP8 activation scales of a row-parallel layer)."""
        if self.world_size == 1 or self.local_only:
            return x
        import torch.distributed as dist
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._run(lambda g: g.allreduce([x], opts))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world_size * n], rank order."""
        if self.world_size == 1:
            return x
        if self.local_only:
            return torch.cat([x] * self.world_size, dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._run(lambda g: g.allgather([parts], [x]), host_wait=True)   # the step's last collective
        return torch.cat(parts, dim=-1)

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape) on rank 0, rank order; None on the others (KV blocks leaving the group)."""
        if self.world_size == 1:
            return [x]
        import torch.distributed as dist
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else []
        wire = [as_bytes(p) for p in parts]
        self._run(lambda g: g.gather([wire] if self.rank == 0 else [], [as_bytes(x)], opts), host_wait=True)
        return parts if self.rank == 0 else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (KV blocks entering the group at rank 0)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._run(lambda g: g.broadcast([as_bytes(x)], opts), host_wait=True)
        return x

    def _run(self, start, host_wait: bool = False) -> None:
        if self.group is None:
            raise CollectiveError(f"rank {self.rank}: no tensor-parallel group formed (the group is incomplete)")
        began = time.perf_counter()
        try:
            work = start(self.group)
            finished = work.wait(self.timeout)
            if self.stream_ordered and host_wait:
                finished = _await_on_host(work, began + self.timeout.total_seconds())
            if not finished:
                raise CollectiveError(f"rank {self.rank}: a collective did not finish in "
                                      f"{self.timeout.total_seconds():g} s")
        except CollectiveError:
            raise
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subtypes for a dead peer
            raise CollectiveError(f"rank {self.rank}: collective failed: {exc}") from exc
        finally:
            self.seconds += time.perf_counter() - began
            self.calls += 1


def _backend(group) -> str:
    name = getattr(group, "name", None)
    return name() if callable(name) else ""


def _await_on_host(work, deadline: float) -> bool:
    """Poll until the device finished the collective (True) or the deadline passed (False); a collective the
    watchdog aborted completes with an error, which wait() raises."""
    while not work.is_completed():
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.0001)
    work.wait()
    return True
