"""Mutual TLS on the internal gRPC links: the cluster serves over it; a client without the right certificate
(none, plaintext, or one from another CA) is refused during the handshake."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.common.tls import TlsConfig, open_channel
from tests.integration.certs import make_certs
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow


async def _model_info(address: str, tls: TlsConfig | None) -> engine_pb2.ModelInfo:
    channel = open_channel(address, tls, []) if tls else grpc.aio.insecure_channel(address)
    async with channel:
        return await engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.ModelInfoRequest(), timeout=5)


def test_mtls_cluster_serves_and_refuses_strangers(tmp_path, model_dir):
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs)
    server = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
              "--tls-ca", str(certs / "ca.pem")]
    client = ["--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key"),
              "--tls-ca", str(certs / "ca.pem")]
    cluster = Cluster(tmp_path, scheduler_args=server, worker_args=client, gateway_args=client)
    try:
        cluster.start()
        status, body = cluster.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                                                        "max_tokens": 3})
        assert status == 200, body
        address = cluster.scheduler_address
        good = TlsConfig(cert=str(certs / "client.pem"), key=str(certs / "client.key"), ca=str(certs / "ca.pem"))
        assert asyncio.run(_model_info(address, good)).num_workers == 1
        strangers = {
            "plaintext": None,
            "no client certificate": TlsConfig(ca=str(certs / "ca.pem")),
            "certificate from another CA": TlsConfig(cert=str(certs / "rogue.pem"), key=str(certs / "rogue.key"),
                                                     ca=str(certs / "ca.pem")),
        }
        for name, tls in strangers.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                asyncio.run(_model_info(address, tls))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name
    finally:
        cluster.stop()
