"""Forming a tensor-parallel group's process group after its ranks attached, with no fixed start order.

    rank 0, at each attach:  GroupStore(tp_host) serves a TCPStore on a fresh port; its address goes in the hello
    scheduler, once all N:   TpGroupForm(generation, rendezvous=that address) to every rank
    every rank:              form_group(...) -> a gloo (CPU) or NCCL (CUDA) ProcessGroup on PrefixStore(generation)

Each re-formed group gets a new generation and rank 0 a new store, so a rank of a broken group can never meet a
rank of the next. The group is a plain ProcessGroup object (no global default group), so leaving it is dropping it.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# NCCL's watchdog on a collective past the group's timeout: 2 = abort the communicator and mark the work failed
# (the default, 3, kills the process), so the rank raises CollectiveError and leaves the group as on gloo (comm.py).
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


class GroupStore:
    """Rank 0's store server for one attach: other ranks connect to `address`."""

    def __init__(self, host: str, world_size: int, timeout: timedelta = timedelta(seconds=60)):
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"


def form_group(rank: int, world_size: int, rendezvous: str, generation: int, timeout: timedelta,
               tp_host: str, device: torch.device, master: GroupStore | None):
    """Blocks until every rank joined (or `timeout`); returns the ProcessGroup."""
    store = _open_store(rank, world_size, rendezvous, timeout, master)
    return _new_group(dist.PrefixStore(f"steploop-tp/{generation}", store), rank, world_size, timeout, tp_host,
                      device, f"tensor-parallel group generation {generation} at {rendezvous}")


def form_stage_groups(rank: int, tp_size: int, pp_size: int, rendezvous: str, generation: int, timeout: timedelta,
                      tp_host: str, device: torch.device, master: GroupStore | None):
    """A pipeline-parallel group (pipeline.py): (its stage's tensor-parallel group, None at -tp 1; the whole
    group of tp x pp ranks, for the stages' sends and receives), both on rank 0's one store."""
    world = tp_size * pp_size
    store = _open_store(rank, world, rendezvous, timeout, master)
    stage, tp_rank = divmod(rank, tp_size)
    tp_group = None
    if tp_size > 1:
        tp_group = _new_group(dist.PrefixStore(f"steploop-tp/{generation}/stage-{stage}", store), tp_rank, tp_size,
                              timeout, tp_host, device, f"stage {stage}'s tensor-parallel group generation "
                              f"{generation}")
    whole = _new_group(dist.PrefixStore(f"steploop-tp/{generation}/pipeline", store), rank, world, timeout, tp_host,
                       device, f"pipeline group generation {generation} at {rendezvous}")
    return tp_group, whole


def _open_store(rank: int, world_size: int, rendezvous: str, timeout: timedelta, master: GroupStore | None):
    host, port = rendezvous.rsplit(":", 1)
    if rank == 0 and master is not None:
        return master.store
    return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)


def _new_group(store, rank: int, size: int, timeout: timedelta, tp_host: str, device: torch.device, what: str):
    if device.type == "cuda":
        os.environ.update(NCCL_ENV)     # read when the group is built
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=tp_host)]
        group = dist.ProcessGroupGloo(store, rank, size, options)
    log.info("rank %d/%d joined %s (%s)", rank, size, what, "nccl" if device.type == "cuda" else "gloo")
    return group
