"""TLS and mutual TLS for the internal gRPC links (gateway → scheduler, worker → scheduler).

The same three flags on every service: `--tls-cert` and `--tls-key` are this service's own certificate (the
scheduler's server certificate, or a client's certificate), `--tls-ca` the CA that signs the peers. On the
scheduler, `--tls-ca` turns on mutual TLS: a client without a certificate from that CA is refused during the
handshake. Without `--tls-cert` links are plaintext, which is why internal ports bind to loopback by default.
"""

from __future__ import annotations

import argparse
import pathlib
from dataclasses import dataclass

import grpc

from steploop.common.envs import add_flag


@dataclass(frozen=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def validate(self) -> "TlsConfig":
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together: give both (this service's certificate and "
                             "its private key) or neither")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not pathlib.Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        return self

    def _read(self, path: str | None) -> bytes | None:
        return pathlib.Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.cert:
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca),
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca),
                                            private_key=self._read(self.key), certificate_chain=self._read(self.cert))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flag(parser, "--tls-cert", help="PEM certificate of this service (server cert on the scheduler, "
                                            "client cert on gateway and worker)")
        add_flag(parser, "--tls-key", help="PEM private key for --tls-cert")
        add_flag(parser, "--tls-ca", help="PEM CA bundle that signs the peers; on the scheduler it requires "
                                          "client certificates (mutual TLS)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TlsConfig":
        return cls(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca).validate()


def add_server_port(server: grpc.aio.Server, address: str, tls: TlsConfig) -> int:
    if tls.enabled:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def open_channel(address: str, tls: TlsConfig, options) -> grpc.aio.Channel:
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)
