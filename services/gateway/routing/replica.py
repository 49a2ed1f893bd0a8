"""Replica: what the router knows of one scheduler replica: its client, this gateway's requests in flight there,
whether it is up (grpc health, a failover cooldown, retired by discovery), and its prefix cache as its KV events
tell it (kv_index.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.kv_index import KvEventWatcher, ReplicaCacheIndex


@dataclass
class Replica:
    client: EngineClient
    in_flight: int = 0
    down_until: float = 0.0
    healthy: bool = True                             # its last grpc health check said SERVING
    routed: int = 0                                  # requests sent here (for logs and tests)
    retired: bool = False                            # removed (discovery): no new requests; slot reusable
    fenced: str = ""                                 # set (why): no new requests (control_fanout.py)
    cache: ReplicaCacheIndex = field(default_factory=ReplicaCacheIndex)   # from its KV events, when in sync
    watcher: KvEventWatcher | None = None

    @property
    def address(self) -> str:
        return self.client.address

    def up(self, now: float) -> bool:
        return self.healthy and not self.retired and not self.fenced and now >= self.down_until
