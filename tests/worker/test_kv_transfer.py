"""Prefill/decode block transfer between workers (gpu_worker/kv_transfer.py) over loopback TCP: blocks arrive
byte-exact in host slots, a block corrupted in flight is refused by its checksum (nothing staged), a receiver that
is not there is a failed send, and staged transfers are discarded on request or when their lease runs out."""

from __future__ import annotations

import socket

import torch

from steploop.common.pd_transfer import PdMoves, PdReceive, PdReport, PdSend
from steploop.common.step_contract import StepPlan, StepResult
from steploop.gpu_worker.kv_transfer import KvReceiver, KvSender, receive

LAYERS, BLOCKS, BS, HK, D = 3, 8, 4, 2, 8
BLOCK_BYTES = LAYERS * 2 * BS * HK * D * 4


def caches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, BLOCKS, BS, HK, D) for _ in range(LAYERS)]


def host(slots: int = 6) -> torch.Tensor:
    return torch.zeros(slots, LAYERS, 2, BS, HK, D)


def block(cs: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.stack([c[:, b] for c in cs])


def test_sent_blocks_land_byte_exact_in_the_reserved_host_slots():
    cs, h = caches(), host()
    receiver = KvReceiver("127.0.0.1", 0, BLOCK_BYTES, lease=60)
    try:
        report = PdReport()
        KvSender(cs, timeout=10).apply(PdMoves(address=receiver.address, sends=[PdSend("r1", [5, 2, 7])]), report)
        assert report.sent == ["r1"] and not report.failed_sends and report.bytes_sent == 3 * BLOCK_BYTES
        got = receive(PdMoves(receives=[PdReceive("r1", [0, 1, 2], [4, 0, 3])]), h, receiver)
        assert not got.failed_recv_slots
        for slot, b in ((4, 5), (0, 2), (3, 7)):
            assert torch.equal(h[slot], block(cs, b))
        assert receiver.num_staged() == 0
    finally:
        receiver.close()


def test_a_block_corrupted_in_flight_is_refused_and_nothing_is_staged():
    cs, h = caches(), host()
    receiver = KvReceiver("127.0.0.1", 0, BLOCK_BYTES, lease=60)
    try:
        sender = KvSender(cs, timeout=10)
        sender.corrupt = True                 # what STEPLOOP_TEST_CORRUPT_KV_TRANSFER=1 switches on
        report = PdReport()
        sender.apply(PdMoves(address=receiver.address, sends=[PdSend("r1", [1, 2])]), report)
        assert report.failed_sends == ["r1"] and not report.sent
        assert receiver.refused == 1 and receiver.num_staged() == 0
        # a receive of a transfer that is not there fills no slot
        got = receive(PdMoves(receives=[PdReceive("r1", [0, 1], [2, 3])]), h, receiver)
        assert got.failed_recv_slots == [2, 3] and not h.any()
    finally:
        receiver.close()


def test_no_receiver_is_a_failed_send():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]             # bound, not listening: the connection is refused
        report = PdReport()
        KvSender(caches(), timeout=2).apply(PdMoves(address=f"127.0.0.1:{port}", sends=[PdSend("r1", [1])]), report)
    assert report.failed_sends == ["r1"]


def test_staged_transfers_are_discarded_or_expire():
    cs = caches()
    receiver = KvReceiver("127.0.0.1", 0, BLOCK_BYTES, lease=60)
    try:
        sender = KvSender(cs, timeout=10)
        sender.apply(PdMoves(address=receiver.address, sends=[PdSend("a", [1]), PdSend("b", [2])]), PdReport())
        assert receiver.num_staged() == 2
        receive(PdMoves(discards=["a"]), host(), receiver)
        assert receiver.num_staged() == 1
        receiver.lease = 0.0                  # the next arrival drops what no plan claimed in time
        sender.apply(PdMoves(address=receiver.address, sends=[PdSend("c", [3])]), PdReport())
        assert receiver.num_staged() == 1
    finally:
        receiver.close()


def test_transfers_cross_the_plan_stream():
    plan = StepPlan(step_id=3, pd_moves=PdMoves(address="h:1", sends=[PdSend("a", [1, 2]), PdSend("b", [3])],
                                                receives=[PdReceive("c", [0, 2], [5, 6])], discards=["d"]))
    assert StepPlan.from_pb(plan.to_pb()).pd_moves == plan.pd_moves
    assert StepPlan.from_pb(StepPlan(step_id=4).to_pb()).pd_moves is None
    result = StepResult(step_id=3, pd_report=PdReport(["a"], ["b"], [6], 0.5, 100))
    assert StepResult.from_pb(result.to_pb()).pd_report == result.pd_report


def test_more_than_the_receiver_may_stage_is_refused():
    cs = caches()
    receiver = KvReceiver("127.0.0.1", 0, BLOCK_BYTES, lease=60, max_blocks=3)
    try:
        report = PdReport()
        KvSender(cs, timeout=10).apply(PdMoves(address=receiver.address, sends=[PdSend("a", [1, 2]),
                                                                             PdSend("b", [3, 4])]), report)
        assert report.sent == ["a"] and report.failed_sends == ["b"] and receiver.num_staged() == 1
    finally:
        receiver.close()


def test_blocks_of_another_size_are_refused_unread():
    receiver = KvReceiver("127.0.0.1", 0, BLOCK_BYTES * 2, lease=60)
    try:
        report = PdReport()
        KvSender(caches(), timeout=10).apply(PdMoves(address=receiver.address, sends=[PdSend("a", [1])]), report)
        assert report.failed_sends == ["a"] and receiver.refused == 1 and receiver.num_staged() == 0
    finally:
        receiver.close()


def test_fp8_blocks_travel_as_bytes_and_another_format_is_refused():
    """An FP8 cache's blocks land bit-exact; e4m3 blocks offered to an e5m2 receiver (the same size) are refused."""
    cs = [c.to(torch.float8_e4m3fn) for c in caches()]
    fp8_bytes = BLOCK_BYTES // 4
    receiver = KvReceiver("127.0.0.1", 0, fp8_bytes, lease=60, dtype=torch.float8_e4m3fn)
    other = KvReceiver("127.0.0.1", 0, fp8_bytes, lease=60, dtype=torch.float8_e5m2)
    try:
        report = PdReport()
        KvSender(cs, timeout=10).apply(PdMoves(address=receiver.address, sends=[PdSend("r1", [5, 2])]), report)
        assert report.sent == ["r1"] and report.bytes_sent == 2 * fp8_bytes
        h = host().to(torch.float8_e4m3fn)
        assert not receive(PdMoves(receives=[PdReceive("r1", [0, 1], [4, 0])]), h, receiver).failed_recv_slots
        for slot, b in ((4, 5), (0, 2)):
            assert torch.equal(h[slot].view(torch.uint8), block(cs, b).view(torch.uint8))
        report = PdReport()
        KvSender(cs, timeout=10).apply(PdMoves(address=other.address, sends=[PdSend("r2", [1])]), report)
        assert report.failed_sends == ["r2"] and other.refused == 1 and other.num_staged() == 0
    finally:
        receiver.close()
        other.close()
