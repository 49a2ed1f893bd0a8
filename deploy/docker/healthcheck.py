"""Container health probe for the images' HEALTHCHECK and Kubernetes exec probes (stdlib + grpcio only).

    healthcheck.py http [URL]        the gateway: GET /health answers 200 (ready: a scheduler is serving)
    healthcheck.py grpc [--alive]    the scheduler: grpc.health.v1 Check on 127.0.0.1:$STEPLOOP_SCHEDULER_PORT
                                     is SERVING (a worker attached, steps finishing); with --alive any answer
                                     counts (the event loop is not hung), for a liveness probe
    healthcheck.py grpc --target H:P the same against another address (the worker asks its scheduler)

TLS comes from the service's own STEPLOOP_TLS_CERT/KEY/CA (mutual TLS: the scheduler's certificate carries
clientAuth too, so it can ask itself); the name checked is STEPLOOP_TLS_SERVER_NAME or localhost.
Exit 0 healthy, 1 not.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import urllib.request


def check_http(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except OSError as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return False


def _read(name: str) -> bytes | None:
    path = os.environ.get(name)
    return pathlib.Path(path).read_bytes() if path else None


def check_grpc(target: str, alive_only: bool, timeout: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ca, cert, key = _read("STEPLOOP_TLS_CA"), _read("STEPLOOP_TLS_CERT"), _read("STEPLOOP_TLS_KEY")
    if ca or cert:
        name = os.environ.get("STEPLOOP_TLS_SERVER_NAME", "localhost")
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        channel = grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", name)])
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as err:
            print(f"unhealthy: {target}: {err.code().name} {err.details()}", file=sys.stderr)
            return False
    if alive_only or reply.status == health_pb2.HealthCheckResponse.SERVING:
        return True
    print(f"not serving: {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
          file=sys.stderr)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["http", "grpc"])
    parser.add_argument("url", nargs="?", default=f"http://127.0.0.1:{os.environ.get('STEPLOOP_PORT', '8000')}/health")
    parser.add_argument("--target", default=f"127.0.0.1:{os.environ.get('STEPLOOP_SCHEDULER_PORT', '50051')}")
    parser.add_argument("--alive", action="store_true", help="any health answer counts (liveness)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    ok = check_http(args.url, args.timeout) if args.kind == "http" else \
        check_grpc(args.target, args.alive, args.timeout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
