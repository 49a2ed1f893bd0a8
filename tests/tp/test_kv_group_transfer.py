"""KV blocks between tensor-parallel groups of any sizes (gpu_worker/kv_heads.py, kv_transfer.py) and KV tiers
under -tp (kv_tier_mover.py), over real gloo groups whose ranks run in threads of this process and real loopback
TCP: a sending group's ranks gather their heads to rank 0, which sends whole blocks; a receiving group's rank 0
takes them and broadcasts, and every rank's host slot holds exactly its heads of the sender's blocks. Verdicts
agree on every rank (a block that failed its check fails everywhere). A disk read that fails on one rank fails the
promote on all; each rank's disk files live in their own folder."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from steploop.common.kv_moves import KvMoves
from steploop.common.pd_transfer import PdMoves, PdReceive, PdReport, PdSend
from steploop.common.step_contract import StepPlan
from steploop.gpu_worker import kv_tier_mover
from steploop.gpu_worker.distributed.comm import TensorParallelComm
from steploop.gpu_worker.distributed.process_group import GroupStore, form_group
from steploop.gpu_worker.kv_heads import KvHeads
from steploop.gpu_worker.kv_transfer import KvReceiver, KvSender, receive
from tests.tp.tp_models import each_rank_in_a_thread

LAYERS, BLOCKS, BS, D = 2, 6, 4, 8


def whole_caches(heads: int) -> list[torch.Tensor]:
    """The model's KV pool as one unsharded worker would hold it: [2, blocks, block_size, heads, head_dim]."""
    torch.manual_seed(heads)
    return [torch.randn(2, BLOCKS, BS, heads, D) for _ in range(LAYERS)]


def share(caches: list[torch.Tensor], heads: KvHeads, rank: int) -> list[torch.Tensor]:
    return [heads.mine(c, rank).contiguous() for c in caches]


def block(caches: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.stack([c[:, b] for c in caches])


def in_group(world: int, body) -> list:
    """body(rank, comm) on `world` ranks, each a thread in one gloo group; their results in rank order."""
    if world == 1:
        return [body(0, None)]
    store = GroupStore("127.0.0.1", world)

    def rank_main(rank: int):
        comm = TensorParallelComm(rank, world)
        timeout = timedelta(seconds=60)
        comm.attach(form_group(rank, world, store.address, 1, timeout, "127.0.0.1", torch.device("cpu"),
                               store if rank == 0 else None), 1, timeout)
        return body(rank, comm)

    return each_rank_in_a_thread(world, rank_main)


@pytest.mark.parametrize("total, world", [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2)])
def test_heads_cut_and_made_whole_again(total, world):
    heads = KvHeads(total, world)
    x = torch.randn(3, BS, total, D)
    parts = [heads.mine(x, r) for r in range(world)]
    assert all(p.shape[-2] == heads.per_rank for p in parts)
    assert torch.equal(heads.whole(parts), x)


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="3 KV heads do not split over 2 ranks"):
        KvHeads(3, 2)


@pytest.mark.parametrize("total, send_world, recv_world", [
    (4, 2, 1),      # a -tp 2 prefill group to a single decode worker
    (4, 1, 2),      # a single prefill worker to a -tp 2 decode group
    (4, 4, 2),      # different sizes both sides
    (2, 4, 2),      # the sender replicates each head on two ranks
    (1, 1, 2),      # the receiver replicates its only head
])
def test_blocks_cross_between_groups_of_any_sizes(total, send_world, recv_world):
    caches = whole_caches(total)
    send_heads, recv_heads = KvHeads(total, send_world), KvHeads(total, recv_world)
    whole_bytes = LAYERS * 2 * BS * total * D * 4
    receiver = KvReceiver("127.0.0.1", 0, whole_bytes, lease=60)
    try:
        def send(rank, comm):
            report = PdReport()
            sender = KvSender(share(caches, send_heads, rank), timeout=10, comm=comm, heads=send_heads)
            sender.apply(PdMoves(address=receiver.address, sends=[PdSend("r1", [4, 1, 5]), PdSend("r2", [])]),
                         report)
            return report

        reports = in_group(send_world, send)
        assert reports[0].sent == ["r1", "r2"] and reports[0].bytes_sent == 3 * whole_bytes
        assert all(not r.sent and not r.bytes_sent for r in reports[1:])    # only rank 0 holds the link

        def land(rank, comm):
            host = torch.zeros(5, LAYERS, 2, BS, recv_heads.per_rank, D)
            got = receive(PdMoves(receives=[PdReceive("r1", [0, 1, 2, 7], [3, 0, 4, 1]), PdReceive("r2", [], [])]),
                          host, receiver if rank == 0 else None, comm, recv_heads)   # r2: every block cached here
            return host, got.failed_recv_slots

        for rank, (host, failed) in enumerate(in_group(recv_world, land)):
            assert failed == [1]                  # index 7 was never sent: failed on every rank alike
            for slot, b in ((3, 4), (0, 1), (4, 5)):
                assert torch.equal(host[slot], recv_heads.mine(block(caches, b), rank))
            assert not host[1].any() and not host[2].any()
        assert receiver.num_staged() == 0
    finally:
        receiver.close()


def test_a_corrupted_transfer_fails_on_every_rank_of_the_receiving_group():
    caches = whole_caches(4)
    heads = KvHeads(4, 2)
    receiver = KvReceiver("127.0.0.1", 0, LAYERS * 2 * BS * 4 * D * 4, lease=60)
    try:
        sender = KvSender(caches, timeout=10)
        sender.corrupt = True
        report = PdReport()
        sender.apply(PdMoves(address=receiver.address, sends=[PdSend("r1", [1, 2])]), report)
        assert report.failed_sends == ["r1"]

        def land(rank, comm):
            host = torch.zeros(3, LAYERS, 2, BS, 2, D)
            got = receive(PdMoves(receives=[PdReceive("r1", [0, 1], [0, 2])]), host,
                          receiver if rank == 0 else None, comm, heads)
            return got.failed_recv_slots, bool(host.any())

        assert in_group(2, land) == [([0, 2], False), ([0, 2], False)]
    finally:
        receiver.close()


def test_a_disk_read_missing_on_one_rank_fails_the_promote_on_all(tmp_path):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.kv_tier_mover import build

    heads = KvHeads(4, 2)
    caches = whole_caches(4)

    def tiers(rank):
        config = WorkerConfig(tensor_parallel_size=2, rank=rank, kv_offloading_size=0.001,
                              kv_disk_path=str(tmp_path), kv_disk_size=0.01)
        return build(config, share(caches, heads, rank), "model", torch.float32, "layout")

    movers = [tiers(0), tiers(1)]
    assert movers[0].disk.folder != movers[1].disk.folder    # each rank's heads in its own files
    key = b"k" * 32

    def step(rank, comm):
        mover = movers[rank]
        kv_tier_mover.apply(mover, StepPlan(step_id=1, kv_moves=KvMoves(stores=[(2, 0)], demotes=[(0, key)])), comm)
        if rank == 1:                              # rank 1 loses its file (a disk error, a cleaned folder)
            mover.disk.drop(key)
        report = kv_tier_mover.apply(mover, StepPlan(step_id=2, kv_moves=KvMoves(promotes=[(key, 1)])), comm)
        return report.failed_promote_slots

    assert in_group(2, step) == [[1], [1]]
