"""SchedulerDiscovery: the gateway's scheduler replicas follow DNS (--scheduler-discovery-interval).

Each --scheduler-address entry `name:port` is re-resolved every interval; every address it resolves to is one
replica in the EngineRouter. Pointed at a Kubernetes headless Service, whose name resolves to the IPs of its
ready pods, a new scheduler replica joins the router once it is ready and a removed or unready one leaves it,
without a gateway restart. Its requests in flight finish first (EngineRouter.remove_replica).

A name with no addresses (NXDOMAIN: no pod is ready) empties the set; a failed lookup (resolver down, timeout)
keeps the last known set, since routing to the replicas known is better than routing nowhere. With TLS the
channel to an IP checks the certificate against `name`, the name the scheduler's certificate carries.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from steploop.common.tls import TlsConfig, open_channel
from steploop.gateway.engine.engine_client import CHANNEL_OPTIONS, EngineClient
from steploop.gateway.routing.router import EngineRouter

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class Target:
    host: str
    port: int

    @classmethod
    def parse(cls, entry: str) -> Target:
        host, sep, port = entry.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or host.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
            raise ValueError(f"--scheduler-discovery-interval needs each --scheduler-address as name:port "
                             f"(a DNS name to re-resolve), got {entry!r}")
        return cls(host.strip("[]"), int(port))


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (empty for a name with none); raises OSError when the lookup fails."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise
    return sorted({_address(info[4][0], port) for info in infos})


def client_factory(tls: TlsConfig, multiplex: bool) -> Callable[[str, str], EngineClient]:
    def make(address: str, server_name: str) -> EngineClient:
        if not tls.enabled:
            return EngineClient(address, tls=tls, multiplex=multiplex)
        options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name)]
        return EngineClient(address, channel=open_channel(address, tls, options), multiplex=multiplex)
    return make


class SchedulerDiscovery:
    def __init__(self, router: EngineRouter, targets: list[Target], make_client: Callable[[str, str], EngineClient],
                 interval_s: float, resolver: Resolver = resolve) -> None:
        self.router, self.targets, self.make_client = router, targets, make_client
        self.interval_s, self.resolver = interval_s, resolver
        self._names: dict[str, str] = {}         # address added -> the target name it was resolved from
        self._task: asyncio.Task | None = None

    async def refresh(self) -> None:
        """One round: resolve every target, add the addresses that are new, remove those that are gone."""
        wanted: dict[str, str] = {}
        for target in self.targets:
            try:
                addresses = await self.resolver(target.host, target.port)
            except OSError as err:
                logger.warning("resolving %s failed (%s); keeping its known replicas", target.host, err)
                addresses = [a for a, name in self._names.items() if name == target.host]
            wanted.update((address, target.host) for address in addresses)
        known = {r.address for r in self.router.live}
        self._names.update(wanted)
        for address in sorted(wanted.keys() - known):
            self.router.add_replica(self.make_client(address, wanted[address]))
            logger.info("scheduler replica %s (%s) joined", address, wanted[address])
        for address in sorted(known - wanted.keys()):
            await self.router.remove_replica(address)
            self._names.pop(address, None)
            logger.info("scheduler replica %s left (no longer in DNS); its requests in flight finish", address)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:   # one bad round must not end discovery for the gateway's lifetime
                logger.exception("scheduler discovery round failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="scheduler-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
