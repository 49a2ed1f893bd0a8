"""Every port `steploop serve` makes its services bind, checked before any of them starts.

A port that is taken would otherwise show up as a gateway that crashes and is restarted until the supervisor
gives up, or as a scheduler /metrics that is silently off; a second `serve` on one machine must move them all.
"""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ServicePort:
    flag: str         # the flag that moves it
    what: str         # what listens there
    host: str         # the interface it binds
    port: int


def serve_ports(args: argparse.Namespace) -> list[ServicePort]:
    """The ports the three services bind under `serve` (a metrics port of 0 binds nothing)."""
    ports = [ServicePort("--port", "the OpenAI API (gateway)", args.host, args.port),
             ServicePort("--scheduler-port", "the scheduler's gRPC", args.scheduler_host, args.scheduler_port),
             ServicePort("--metrics-port", "the scheduler's /metrics", args.scheduler_host, args.metrics_port),
             # the worker's metrics server listens on every interface (services/gpu_worker/server.py)
             ServicePort("--worker-metrics-port", "the worker's /metrics", "0.0.0.0", args.worker_metrics_port)]
    return [p for p in ports if p.port != 0]


def check_ports_free(ports: list[ServicePort]) -> None:
    """ValueError naming the flag to change when two services would share a port or one is already taken."""
    by_number: dict[int, ServicePort] = {}
    for port in ports:
        if port.port in by_number:
            raise ValueError(f"{port.flag} and {by_number[port.port].flag} are both {port.port}: give each its "
                             "own port")
        by_number[port.port] = port
        reason = _bind_error(port.host, port.port)
        if reason:
            raise ValueError(f"port {port.port} on {port.host} ({port.flag}, {port.what}) is not free: {reason}; "
                             f"move it with {port.flag} N (another `steploop serve` on this machine needs "
                             "--port, --scheduler-port and --metrics-port of its own)")


def _bind_error(host: str, port: int) -> str | None:
    """Why a listening socket cannot bind host:port now, or None. SO_REUSEADDR as the servers set it, so a port
    in TIME_WAIT after a stop counts as free; a port another process listens on does not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None
