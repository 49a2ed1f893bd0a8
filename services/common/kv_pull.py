"""Cross-replica KV pull: the contract between the router, the replica that got a request (B) and the replica
that caches its prompt's prefix (A).

  router      sees in A's KV events that A's pool holds the prompt's first N blocks, sends the request to B (A is
              loaded, or affinity says B) with a KvPullHint(A's address, N) when its cost estimate says copying
              beats recomputing (gateway/routing/kv_pull_cost.py);
  B           keys those blocks itself, reserves host slots and asks A (Engine.ExportKvBlocks) to send the ones
              its own pool lacks to B's worker's receiver (scheduler/kv_pull_import.py);
  A           pins the leading blocks its pool still holds (a lease: until its worker's send is acknowledged or
              fails), sends them in its next plan (a CRC32 per block, gpu_worker/kv_transfer.py), unpins, and
              answers how many went (scheduler/kv_pull_export.py);
  B           copies what arrived into the host slots (checksums checked again), the request restores them like
              any host-tier prefix and computes the rest. Anything short of that is a recompute, never a wrong token.
"""

from __future__ import annotations

from dataclasses import dataclass

from steploop.common.pb.steploop.v1 import engine_pb2


@dataclass(frozen=True, slots=True)
class KvPullHint:
    source: str             # A's scheduler (Engine) address, host:port
    num_blocks: int         # the prompt's first full blocks A's pool holds, by its KV events

    def to_pb(self) -> engine_pb2.KvPullHint:
        return engine_pb2.KvPullHint(source=self.source, num_blocks=self.num_blocks)

    @classmethod
    def from_pb(cls, pb: engine_pb2.KvPullHint) -> KvPullHint | None:
        return cls(pb.source, pb.num_blocks) if pb.source and pb.num_blocks else None


@dataclass(frozen=True, slots=True)
class KvExport:
    """A's answer: the leading blocks sent and acknowledged (0: none), and why not all."""
    num_blocks: int
    bytes: int = 0
    reason: str = ""

    def to_pb(self) -> engine_pb2.KvExportReply:
        return engine_pb2.KvExportReply(num_blocks=self.num_blocks, bytes=self.bytes, reason=self.reason)

    @classmethod
    def from_pb(cls, pb: engine_pb2.KvExportReply) -> KvExport:
        return cls(pb.num_blocks, pb.bytes, pb.reason)
