"""ReplicaSet: the router's scheduler replicas as they come, go and fail.

The list keeps its slots: a replica discovery removes is retired (no new requests; those in flight finish, then
its channel closes) and its slot is reused by the next one added, so the affinity map's indices stay valid hints.
Each replica's grpc health is polled every `health_interval_s`: one that is not SERVING (no worker attached,
hung, draining) gets no new requests while another one is, and its live requests are evicted so that
migration.py moves them. With `kv_events`, each replica's KV events are watched (kv_index.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.routing.kv_index import KvEventWatcher
from steploop.gateway.routing.migration import draining_error
from steploop.gateway.routing.replica import Replica

logger = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, clients: Sequence[EngineClient], *, health_interval_s: float, kv_events: bool) -> None:
        self.replicas = [Replica(c) for c in clients]
        self.health_interval_s = health_interval_s
        self.kv_events = kv_events                   # watch replicas' KV events (those with them off: guess)
        self._poller: asyncio.Task | None = None

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if not r.retired]

    def start(self) -> None:
        """Started with the first routed request (the router is built before the event loop serves)."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._health_loop(), name="replica-health")
            for replica in self.live:
                self._watch(replica)

    def _watch(self, replica: Replica) -> None:
        if self.kv_events and replica.watcher is None:
            replica.watcher = KvEventWatcher(replica.client, replica.cache)
            replica.watcher.start()

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    def add(self, client: EngineClient) -> None:
        """Routes to `client` from now on, in a retired slot whose requests have all ended, else a new one."""
        new = Replica(client)
        for index, replica in enumerate(self.replicas):
            if replica.retired and replica.in_flight == 0:
                self.replicas[index] = new
                break
        else:
            self.replicas.append(new)
        if self._poller is not None:
            self._watch(new)

    async def remove(self, address: str) -> None:
        """No new requests go to `address`; those in flight there finish, then its channel closes."""
        for replica in self.live:
            if replica.address == address:
                replica.retired = True
                if replica.watcher is not None:
                    await replica.watcher.stop()
                if replica.in_flight == 0:
                    await replica.client.close()

    async def check_health(self) -> list[bool]:
        live = self.live
        states = await asyncio.gather(*(r.client.health() for r in live))
        for replica, serving in zip(live, states):
            if replica.healthy != serving:
                log = logger.info if serving else logger.warning
                log("scheduler %s is %s", replica.address, "serving again" if serving else
                    "not serving: no new requests go there until it is")
            replica.healthy = serving
        now = time.monotonic()
        for replica, serving in zip(live, states):
            if not serving and replica.in_flight and any(r.up(now) for r in live):   # somewhere to go
                moved = replica.client.evict(lambda a=replica.address: draining_error(a))
                if moved:
                    logger.warning("scheduler %s is not serving: migrating its %d live requests", replica.address,
                                   moved)
        return states

    def samples(self) -> list[tuple[str, str, str, dict[str, float]]]:
        """(name, type, help, {replica: value}) of the router's own per-replica series, for /metrics."""
        now, live = time.monotonic(), self.live
        return [
            ("steploop:replica_up", "gauge", "1 while the gateway routes new requests to this scheduler replica",
             {r.address: float(r.up(now)) for r in live}),
            ("steploop:replica_in_flight", "gauge", "Requests this gateway has in flight on the replica",
             {r.address: float(r.in_flight) for r in live}),
            ("steploop:replica_routed", "counter", "Requests this gateway sent to the replica (failover tries too)",
             {r.address: float(r.routed) for r in live}),
            ("steploop:replica_kv_events_synced", "gauge",
             "1 while the router's view of the replica's prefix cache follows its KV events (0: routing by guess)",
             {r.address: float(r.cache.synced) for r in live}),
            ("steploop:replica_kv_cached_blocks", "gauge", "Prefix-cache blocks the replica's KV events say it holds",
             {r.address: float(len(r.cache.keys)) for r in live if r.cache.synced}),
            ("steploop:replica_kv_events_sequence", "gauge",
             "The next KV event batch expected from the replica (all before it are applied)",
             {r.address: float(r.cache.next_sequence) for r in live if r.cache.synced}),
        ]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(r.watcher.stop() for r in self.replicas if r.watcher is not None))
        await asyncio.gather(*(r.client.close() for r in self.replicas if not (r.retired and r.in_flight == 0)))
