"""Prefill/decode transfers of one step (steploop.v1.StepPlan pd_* fields) and the worker's word on them.

The scheduler (scheduler/pd_disagg.py) puts a transfer in both groups' plans:

  prefill plan   sends      after the forward, the prompt's full pool blocks go to the decode worker's receiver
                            (gpu_worker/kv_transfer.py), a CRC32 per block; the step ends once the receiver
                            verified every checksum and acknowledged, or the send failed or timed out. The prefill
                            pool keeps the blocks until then: that step is the prefill side's lease.
  decode plan    receives   before the forward, verified blocks are copied into host-tier slots the scheduler
                            reserved; the request then restores them like any host-tier prefix (kv_tiers.py).
                 discards   received transfers no request will use (aborted, or fallen back to recompute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steploop.common.pb.steploop.v1 import worker_pb2


@dataclass
class PdSend:
    transfer_id: str
    block_ids: list[int]


@dataclass
class PdReceive:
    transfer_id: str
    indexes: list[int]       # block i of the transfer ...
    slots: list[int]         # ... goes to host slot slots[i]


@dataclass
class PdMoves:
    address: str = ""                                   # the decode worker's receiver (sends only)
    sends: list[PdSend] = field(default_factory=list)
    receives: list[PdReceive] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.receives or self.discards)

    def fill_pb(self, pb: worker_pb2.StepPlan) -> None:
        pb.pd_send_address = self.address
        for send in self.sends:
            pb.pd_send_ids.append(send.transfer_id)
            pb.pd_send_counts.append(len(send.block_ids))
            pb.pd_send_blocks.extend(send.block_ids)
        for recv in self.receives:
            pb.pd_recv_ids.append(recv.transfer_id)
            pb.pd_recv_counts.append(len(recv.slots))
            pb.pd_recv_indexes.extend(recv.indexes)
            pb.pd_recv_slots.extend(recv.slots)
        pb.pd_discard_ids.extend(self.discards)

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepPlan) -> PdMoves | None:
        moves, pos = cls(address=pb.pd_send_address, discards=list(pb.pd_discard_ids)), 0
        for tid, n in zip(pb.pd_send_ids, pb.pd_send_counts):
            moves.sends.append(PdSend(tid, list(pb.pd_send_blocks[pos:pos + n])))
            pos += n
        pos = 0
        for tid, n in zip(pb.pd_recv_ids, pb.pd_recv_counts):
            moves.receives.append(PdReceive(tid, list(pb.pd_recv_indexes[pos:pos + n]),
                                            list(pb.pd_recv_slots[pos:pos + n])))
            pos += n
        return moves or None


@dataclass
class PdReport:
    sent: list[str] = field(default_factory=list)            # acknowledged by the receiver, every checksum good
    failed_sends: list[str] = field(default_factory=list)    # refused, timed out, checksum mismatch, link down
    failed_recv_slots: list[int] = field(default_factory=list)   # host slots a receive did not fill
    seconds: float = 0.0
    bytes_sent: int = 0

    def fill_pb(self, pb: worker_pb2.StepResult) -> None:
        pb.pd_sent_ids.extend(self.sent)
        pb.pd_failed_send_ids.extend(self.failed_sends)
        pb.pd_failed_recv_slots.extend(self.failed_recv_slots)
        pb.pd_send_seconds = self.seconds
        pb.pd_sent_bytes = self.bytes_sent

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepResult) -> PdReport | None:
        if not (pb.pd_sent_ids or pb.pd_failed_send_ids or pb.pd_failed_recv_slots):
            return None
        return cls(list(pb.pd_sent_ids), list(pb.pd_failed_send_ids), list(pb.pd_failed_recv_slots),
                   pb.pd_send_seconds, pb.pd_sent_bytes)
